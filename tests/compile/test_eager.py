"""call_implementations_directly: a served graph's calls of autodeploy's Python ops become plain calls of their
implementations, with the same results; ops with a kernel per device, or an implementation that cannot be imported
by its name, keep their op."""

import torch
from torch import nn
from torch.fx import symbolic_trace

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.compile.eager import call_implementations_directly
from autodeploy.custom_ops.quant_linear import int8_linear_reference, quantize_per_channel_int8
from autodeploy.custom_ops.rope import rope_reference


class RopeThenInt8(nn.Module):
    def forward(self, q, k, cos, sin, x, weight, scale):
        rotated = torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default(q, k, cos, sin, 2)
        return rotated[0], rotated[1], torch.ops.auto_deploy.torch_int8_linear.default(x, weight, scale)


def test_the_ops_become_calls_of_their_implementations_with_the_same_results():
    gen = torch.Generator().manual_seed(0)
    weight, scale = quantize_per_channel_int8(torch.randn(24, 64, generator=gen))
    args = (torch.randn(1, 5, 4, 16, generator=gen), torch.randn(1, 5, 2, 16, generator=gen),
            torch.randn(1, 5, 16, generator=gen), torch.randn(1, 5, 16, generator=gen),
            torch.randn(1, 20, 64, generator=gen), weight, scale)
    gm = symbolic_trace(RopeThenInt8())
    before = gm(*args)
    assert call_implementations_directly(gm) == 2
    targets = {node.target for node in gm.graph.nodes if node.op == "call_function"}
    assert {rope_reference, int8_linear_reference} <= targets
    assert not any(isinstance(t, torch._ops.OpOverload) and t.namespace == "auto_deploy" for t in targets)
    for got, want in zip(gm(*args), before):
        assert torch.equal(got, want)
    assert "rope_reference" in gm.code and "int8_linear_reference" in gm.code


def test_ops_with_a_kernel_per_device_or_a_local_implementation_keep_their_op():
    @torch.library.custom_op("auto_deploy::eager_test_per_device", mutates_args=())
    def per_device(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @per_device.register_kernel("cpu")
    def _(x):
        return x + 2

    @torch.library.custom_op("auto_deploy::eager_test_local", mutates_args=())
    def local(x: torch.Tensor) -> torch.Tensor:  # defined in a function: not importable by its name
        return x * 3

    class Both(nn.Module):
        def forward(self, x):
            return torch.ops.auto_deploy.eager_test_local.default(
                torch.ops.auto_deploy.eager_test_per_device.default(x))

    gm = symbolic_trace(Both())
    assert call_implementations_directly(gm) == 0
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 9.0))  # the cpu kernel ran: (1 + 2) * 3

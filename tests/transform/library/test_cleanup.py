"""post_export clean-ups: op counts before/after and unchanged numerics on small exported graphs."""

import torch

from autodeploy.export.export import _flatten_io
from autodeploy.transform import PipelineContext, TransformConfig, TransformRegistry, transform_history

aten = torch.ops.aten


def _export(module: torch.nn.Module, *args) -> torch.fx.GraphModule:
    batch = torch.export.Dim("batch", min=1, max=16)
    dynamic = tuple({0: batch} for _ in args)
    return _flatten_io(torch.export.export(module, args, dynamic_shapes=dynamic).module())


def _run(key: str, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    transform = TransformRegistry.get(key)(TransformConfig(stage="post_export"))
    return transform(gm, PipelineContext())


def _count(gm, target) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


class Slices(torch.nn.Module):
    def forward(self, x, y):
        whole = y[: x.shape[0]]  # no-op: x and y share the batch dim (export keeps this slice)
        half = x[:, : x.shape[1] // 2]  # a real slice
        return whole * 2, half


class Adds(torch.nn.Module):
    def forward(self, x):
        a = x + torch.zeros_like(x)  # no-op
        b = 0 + a  # no-op (scalar)
        c = b + torch.zeros(1, 8)  # no-op: broadcasting keeps x's shape and dtype
        d = torch.zeros(3, 8) + x[:1]  # NOT a no-op: the zeros broadcast x[:1] to 3 rows
        return c, d


def test_noop_slice_removed_real_slice_kept():
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    gm = _export(Slices(), x, y)
    before = _count(gm, aten.slice.Tensor)
    expected = gm(x, y)
    gm = _run("cleanup_noop_slice", gm)
    info = transform_history(gm)["cleanup_noop_slice"].info
    assert info.num_matches >= 1 and not info.skipped
    assert _count(gm, aten.slice.Tensor) == before - info.num_matches
    assert _count(gm, aten.slice.Tensor) >= 1  # x[:, :4] stays
    for out, ref in zip(gm(x, y), expected):
        torch.testing.assert_close(out, ref)
    x5, y5 = torch.randn(5, 8), torch.randn(5, 8)  # still dynamic
    torch.testing.assert_close(gm(x5, y5)[0], y5 * 2)


def test_noop_add_removed_broadcasting_add_kept():
    x = torch.randn(3, 8)
    gm = _export(Adds(), x)
    before = _count(gm, aten.add.Tensor)
    expected = gm(x)
    gm = _run("cleanup_noop_add", gm)
    assert transform_history(gm)["cleanup_noop_add"].info.num_matches == 3
    assert _count(gm, aten.add.Tensor) == before - 3 == 1
    for out, ref in zip(gm(x), expected):
        torch.testing.assert_close(out, ref)


class Guarded(torch.nn.Module):
    def forward(self, x):
        n = x.shape[0]
        torch._check(n <= 16)
        return x.sum(0) * n


def test_input_constraints_removed():
    x = torch.randn(3, 8)
    gm = _export(Guarded(), x)
    constraints = [n for n in gm.graph.nodes if n.op == "call_module" or "assert" in str(n.target)]
    assert constraints, "export should have produced guard/assert nodes"
    gm = _run("cleanup_input_constraints", gm)
    assert transform_history(gm)["cleanup_input_constraints"].info.num_matches == len(constraints)
    assert not [n for n in gm.graph.nodes if n.op == "call_module" or "assert" in str(n.target)]
    assert not hasattr(gm, "_guards_fn")
    torch.testing.assert_close(gm(x)[0], x.sum(0) * 3)


def test_nothing_to_clean_reports_zero_matches():
    gm = _export(Slices(), torch.randn(3, 8), torch.randn(3, 8))
    gm = _run("cleanup_noop_add", gm)
    info = transform_history(gm)["cleanup_noop_add"].info
    assert info.num_matches == 0 and not info.skipped


class Casts(torch.nn.Module):
    def forward(self, x):
        same = x.to(torch.float32)  # no-op on fp32 input
        residual = same + 1  # refers to the cast node after export
        half = same.to(torch.bfloat16)  # a real conversion
        return residual, half


def test_noop_casts_removed_real_casts_kept():
    x = torch.randn(3, 8)
    gm = _export(Casts(), x)
    conversions = (aten.to.dtype, aten._to_copy.default)
    before = sum(_count(gm, t) for t in conversions)
    gm = _run("cleanup_noop_to", gm)
    assert transform_history(gm)["cleanup_noop_to"].info.num_matches == 1
    assert sum(_count(gm, t) for t in conversions) == before - 1 >= 1
    residual, half = gm(x)
    torch.testing.assert_close(residual, x + 1)
    assert half.dtype == torch.bfloat16

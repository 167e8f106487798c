"""match_layernorm_pattern and fuse_layernorm: op counts and numerics on small graphs and tiny models."""

import pytest
import torch

import autodeploy
from autodeploy.transform import transform_history
from helpers import count, export_gm, num_matches, run_transform
from tiny_models import hf_reference, random_batch

aten = torch.ops.aten
LAYERNORM = torch.ops.auto_deploy.torch_layernorm.default
BATCH, CLEANUP = {0: torch.export.Dim("batch", min=1, max=16)}, ["cleanup_input_constraints", "cleanup_noop_to"]


class Decomposed(torch.nn.Module):
    """A LayerNorm written out the way models write it (Cohere's CohereLayerNorm is ``shared=False``,
    ``weight_first=True``, ``bias=False``)."""

    def __init__(self, hidden=16, eps=1e-5, bias=True, weight=True, weight_first=True, shared=False, exponent=2):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden)) if weight else None
        self.bias = torch.nn.Parameter(torch.randn(hidden)) if bias else None
        self.eps, self.weight_first, self.shared, self.exponent = eps, weight_first, shared, exponent

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        mean = h.mean(-1, keepdim=True)
        if self.shared:
            c = h - mean
            h = c * torch.rsqrt(c.pow(self.exponent).mean(-1, keepdim=True) + self.eps)
        else:
            var = (h - mean).pow(self.exponent).mean(-1, keepdim=True)
            h = (h - mean) * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            w = self.weight.to(torch.float32)
            h = w * h if self.weight_first else h * w
        if self.bias is not None:
            h = h + self.bias.to(torch.float32)
        return h.to(dtype)


class Block(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.lin = norm, torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(self.norm(x)) + x


def _run(module, x):
    gm = export_gm(module, x, dims=BATCH, cleanup=CLEANUP)
    return gm, run_transform("match_layernorm_pattern", gm, "pattern_matcher")


def _check(module, x, expected, exact=False):
    module = module.to(x.dtype)
    gm = export_gm(module, x, dims=BATCH, cleanup=CLEANUP)
    aten_before = count(gm, aten.layer_norm.default)
    rsqrt_before = count(gm, aten.rsqrt.default)
    gm = run_transform("match_layernorm_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_layernorm_pattern") == expected == count(gm, LAYERNORM)
    assert count(gm, aten.layer_norm.default) + count(gm, aten.rsqrt.default) == aten_before + rsqrt_before - expected
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta
    x2 = torch.randn(5, *x.shape[1:]).to(x.dtype)  # the batch dim stays dynamic
    for inp in (x, x2):
        with torch.no_grad():
            out, ref = gm(inp)[0], module(inp)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        tol = dict(atol=0, rtol=0) if exact else (dict(atol=1e-5, rtol=1e-5) if x.dtype == torch.float32 else {})
        torch.testing.assert_close(out, ref, **tol)
    return gm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_nn_layernorm(bias, dtype):
    x = torch.randn(3, 7, 16).to(dtype)
    gm = _check(Block(torch.nn.LayerNorm(16, bias=bias)), x, 1, exact=dtype == torch.bfloat16)
    (node,) = gm.graph.find_nodes(op="call_function", target=LAYERNORM)
    assert (node.args[2] is None) == (not bias)


def test_non_parametric_layernorm():  # OLMo: F.layer_norm without weight and bias
    class Olmo(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, (16,), None, None, 1e-5) * 2

    _check(Olmo(), torch.randn(3, 16), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kwargs", [{}, {"bias": False}, {"weight_first": False}, {"shared": True}, {"bias": False, "weight": False}],
    ids=["weight_bias", "cohere", "normed_first", "shared_sub", "no_affine"],
)
def test_decomposed(kwargs, dtype):
    _check(Block(Decomposed(**kwargs)), torch.randn(3, 16).to(dtype), 1, exact=dtype == torch.bfloat16)


def test_decomposed_head_norm_2d_weight():  # Cohere's q/k norms: weight [heads, head_dim]
    class HeadNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = Decomposed(bias=False)
            self.norm.weight = torch.nn.Parameter(torch.randn(4, 16))

        def forward(self, x):
            return self.norm(x.view(x.shape[0], 4, 16))

    _check(HeadNorm(), torch.randn(3, 64), 1)


def test_not_a_variance_left_alone():
    _, gm = _run(Decomposed(exponent=3), torch.randn(3, 16))
    assert num_matches(gm, "match_layernorm_pattern") == 0 and count(gm, LAYERNORM) == 0


def test_weight_that_broadcasts_wider_stays_outside():
    """x [3, 8, 1] normalized over its size-1 last dim, a [8] weight broadcasting it to [3, 8, 8]: the
    weighted form is not the op's (its output would change shape); only the bare norm is matched."""
    module = Decomposed(hidden=8)
    x = torch.randn(3, 8, 1)
    _, gm = _run(module, x)
    (node,) = gm.graph.find_nodes(op="call_function", target=LAYERNORM)
    assert node.args[1] is None and node.args[2] is None
    with torch.no_grad():
        torch.testing.assert_close(gm(x)[0], module(x))


def test_low_precision_norm_left_alone():
    class Bf16Norm(torch.nn.Module):  # computed in bf16 without the upcast: the op would compute differently
        def forward(self, x):
            mean = x.mean(-1, keepdim=True)
            return (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + 1e-5)

    _, gm = _run(Bf16Norm(), torch.randn(3, 16, dtype=torch.bfloat16))
    assert num_matches(gm, "match_layernorm_pattern") == 0


def test_layer_norm_over_two_dims_left_alone():
    class TwoDims(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, (4, 16), None, None, 1e-5)

    _, gm = _run(TwoDims(), torch.randn(3, 4, 16))
    info = transform_history(gm)["match_layernorm_pattern"].info
    assert info.num_matches == 0 and count(gm, aten.layer_norm.default) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_layernorm_back_to_aten(dtype):
    module = Block(Decomposed(bias=True)).to(dtype)
    x = torch.randn(3, 16).to(dtype)
    gm = export_gm(module, x, dims=BATCH, cleanup=CLEANUP)
    gm = run_transform("match_layernorm_pattern", gm, "pattern_matcher")
    fused = run_transform("fuse_layernorm", gm, "post_load_fusion")
    # fp32: x, weight and bias share a dtype -> fused; bf16: the op holds the fp32-cast weight -> left alone
    expected = 1 if dtype == torch.float32 else 0
    assert num_matches(fused, "fuse_layernorm") == expected == count(fused, aten.layer_norm.default)
    with torch.no_grad():
        torch.testing.assert_close(fused(x)[0], module(x), **({"atol": 1e-5, "rtol": 1e-5} if expected else {}))


@pytest.mark.parametrize("arch", ["gpt2", "cohere"])  # nn.LayerNorm with bias; Cohere's decomposed, no bias
def test_architectures(arch, tmp_path):
    from autodeploy.coverage import make_checkpoint

    path = make_checkpoint(arch, tmp_path / arch)
    gm = autodeploy.optimize(path, until="pattern_matcher")
    reference = hf_reference(path)
    layers = reference.config.num_hidden_layers
    expected = {"gpt2": 2 * layers + 1, "cohere": layers + 1}[arch]
    assert count(gm, LAYERNORM) == expected == num_matches(gm, "match_layernorm_pattern")
    assert count(gm, aten.layer_norm.default) == count(gm, aten.rsqrt.default) == 0
    gm = autodeploy.optimize(path, until="post_load_fusion")
    assert count(gm, LAYERNORM) == 0 and count(gm, aten.layer_norm.default) == expected  # fused back
    for batch, seq in [(1, 6), (3, 5)]:
        input_ids, position_ids = random_batch(batch, seq, seed=batch + seq)
        with torch.no_grad():
            logits = gm(input_ids, position_ids)[0]
            ref = reference(input_ids=input_ids, position_ids=position_ids).logits
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)

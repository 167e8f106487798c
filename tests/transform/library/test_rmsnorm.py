"""match_rmsnorm_pattern: op counts and numerics on small exported graphs, then per architecture."""

import json

import pytest
import torch

import autodeploy
from autodeploy.transform import transform_history
from helpers import count, export_gm, num_matches, run_transform
from tiny_models import ARCHS, hf_reference, random_batch

aten = torch.ops.aten
RMSNORM = torch.ops.auto_deploy.torch_rmsnorm.default
MATCHERS = {
    "transforms.match_moe_pattern.stage": "pattern_matcher",
    "transforms.match_rmsnorm_pattern.stage": "pattern_matcher",
}
# export like the pipeline does: dynamic batch, export's assertion nodes removed
BATCH, CLEANUP = {0: torch.export.Dim("batch", min=1, max=16)}, ["cleanup_input_constraints"]


def _matches(gm) -> int:
    return num_matches(gm, "match_rmsnorm_pattern")


class Norm(torch.nn.Module):
    """Configurable RMSNorm the way models write it."""

    def __init__(self, hidden=16, eps=1e-6, weight_first=True, upcast=True, exponent=2, dim=-1, gemma=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.eps, self.weight_first, self.upcast = eps, weight_first, upcast
        self.exponent, self.dim, self.gemma = exponent, dim, gemma

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32) if self.upcast else x
        h = h * torch.rsqrt(h.pow(self.exponent).mean(self.dim, keepdim=True) + self.eps)
        if self.gemma:  # Gemma: scale by (1 + weight) in fp32, then cast
            return (h * (1.0 + self.weight.float())).type_as(x)
        h = h.to(dtype) if self.upcast else h
        return self.weight * h if self.weight_first else h * self.weight


class Block(torch.nn.Module):
    """Two norms around a linear layer, a residual that reuses the norm input."""

    def __init__(self, **kw):
        super().__init__()
        self.n1 = Norm(**kw)
        self.n2 = Norm(eps=1e-5, **{k: v for k, v in kw.items() if k != "eps"})
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.n2(x + self.lin(self.n1(x)))


def _check(module, x, expected_matches, exact=True):
    module = module.to(x.dtype)
    gm = export_gm(module, x, dims=BATCH, cleanup=CLEANUP)
    with torch.no_grad():
        expected = module(x)
    rsqrt_before = count(gm, aten.rsqrt.default)
    gm = run_transform("match_rmsnorm_pattern", gm, "pattern_matcher")
    assert _matches(gm) == expected_matches
    assert count(gm, RMSNORM) == expected_matches
    assert count(gm, aten.rsqrt.default) == rsqrt_before - expected_matches
    for node in gm.graph.nodes:  # shapes stay current
        if node.op == "call_function":
            assert "val" in node.meta
    with torch.no_grad():
        out = gm(x)[0]
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if exact:
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
    x2 = torch.randn(5, *x.shape[1:]).to(x.dtype)  # the batch dim stays dynamic
    with torch.no_grad():
        torch.testing.assert_close(gm(x2)[0], module(x2), atol=0, rtol=0)
    return gm


@pytest.mark.parametrize("weight_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_rmsnorm_both_weight_orders(weight_first, dtype):
    gm = _check(Block(weight_first=weight_first), torch.randn(3, 7, 16).to(dtype), 2)
    eps = sorted(n.args[2] for n in gm.graph.find_nodes(op="call_function", target=RMSNORM))
    assert eps == [1e-6, 1e-5]


def test_fp32_graph_after_noop_cast_cleanup():
    module, x = Block(), torch.randn(3, 7, 16)
    gm = run_transform("cleanup_noop_to", export_gm(module, x, dims=BATCH, cleanup=CLEANUP), "post_export")
    assert count(gm, aten.to.dtype) == 0
    gm = run_transform("match_rmsnorm_pattern", gm, "pattern_matcher")
    assert _matches(gm) == 2
    torch.testing.assert_close(gm(x)[0], module(x), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_style_head_norm_4d(dtype):
    _check(Norm(hidden=8), torch.randn(2, 5, 4, 8).to(dtype), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_one_plus_weight(dtype):
    # matched as torch_rmsnorm(x_fp32, 1 + weight_fp32): the same fp32 products; the cast stays
    gm = _check(Norm(gemma=True), torch.randn(3, 7, 16).to(dtype), 1)
    (node,) = gm.graph.find_nodes(op="call_function", target=RMSNORM)
    assert node.meta["val"].dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,dtype",
    [
        ({"exponent": 4}, torch.float32),  # not a mean of squares
        ({"dim": 1}, torch.float32),  # not over the hidden dim
        ({"upcast": False}, torch.bfloat16),  # computed in bf16: the op would upcast
    ],
)
def test_not_an_rmsnorm_left_alone(kwargs, dtype):
    _check(Norm(**kwargs), torch.randn(3, 7, 16).to(dtype), 0)


class CastsElsewhere(torch.nn.Module):
    """The normalized value is cast to another dtype than the input's: not what the op computes."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, dtype=torch.float16))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(torch.float16)


def test_cast_to_other_dtype_left_alone():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    module = CastsElsewhere()
    gm = export_gm(module, x, dims=BATCH, cleanup=CLEANUP)
    gm = run_transform("match_rmsnorm_pattern", gm, "pattern_matcher")
    # not the weighted op: the fp32 normalization alone becomes the weightless op, the cast and the
    # multiply by the fp16 weight stay outside it
    (node,) = gm.graph.find_nodes(op="call_function", target=RMSNORM)
    assert node.args[1] is None and node.meta["val"].dtype == torch.float32
    assert count(gm, aten.mul.Tensor) == 1  # the weight's multiply
    with torch.no_grad():
        torch.testing.assert_close(gm(x)[0], module(x), atol=0, rtol=0)


def test_nothing_to_match_reports_zero():
    gm = export_gm(torch.nn.Linear(16, 16), torch.randn(3, 16), dims=BATCH, cleanup=CLEANUP)
    gm = run_transform("match_rmsnorm_pattern", gm, "pattern_matcher")
    info = transform_history(gm)["match_rmsnorm_pattern"].info
    assert info.num_matches == 0 and not info.skipped


# -- per architecture ---------------------------------------------------------------------------
SHAPES = [(1, 6), (3, 5)]


@pytest.mark.slow  # every architecture against HF
@pytest.mark.parametrize("arch", ARCHS)
def test_architectures(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    gm = autodeploy.optimize(path, until="weight_load", overrides=MATCHERS)
    reference = hf_reference(path)
    layers = reference.config.num_hidden_layers
    expected = 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)
    assert count(gm, RMSNORM) == expected == _matches(gm)
    assert count(gm, aten.rsqrt.default) == 0
    for batch, seq in SHAPES:
        input_ids, position_ids = random_batch(batch, seq, seed=batch + seq)
        with torch.no_grad():
            logits = gm(input_ids, position_ids)[0]
            ref = reference(input_ids=input_ids, position_ids=position_ids).logits
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_bf16_qwen3_matches_unmatched_graph_exactly(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    plain = autodeploy.optimize(path, until="weight_load", overrides={"dtype": "bfloat16"})
    gm = autodeploy.optimize(path, until="weight_load", overrides={**MATCHERS, "dtype": "bfloat16"})
    assert count(gm, RMSNORM) == 4 * 2 + 1 and count(gm, aten.rsqrt.default) == 0
    input_ids, position_ids = random_batch(2, 7)
    with torch.no_grad():
        out, ref = gm(input_ids, position_ids)[0], plain(input_ids, position_ids)[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


# -- post_load_fusion: fuse_rmsnorm -------------------------------------------------------------
RMS_NORM = aten.rms_norm.default


def _fuse_rmsnorm(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    return run_transform("fuse_rmsnorm", gm, "post_load_fusion")


def test_fuse_rmsnorm_llama_bitwise_equal(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    gm = autodeploy.optimize(path, until="weight_load")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    assert count(gm, RMSNORM) == 2 * layers + 1 and count(gm, RMS_NORM) == 0
    inputs = [random_batch(batch, seq, seed=batch + seq) for batch, seq in SHAPES]
    with torch.no_grad():
        before = [gm(ids, pos)[0] for ids, pos in inputs]
    eps = sorted(n.args[2] for n in gm.graph.find_nodes(op="call_function", target=RMSNORM))
    gm = _fuse_rmsnorm(gm)
    assert transform_history(gm)["fuse_rmsnorm"].info.num_matches == 2 * layers + 1
    assert count(gm, RMSNORM) == 0 and count(gm, RMS_NORM) == 2 * layers + 1
    fused = gm.graph.find_nodes(op="call_function", target=RMS_NORM)
    assert sorted(n.args[3] for n in fused) == eps  # the eps carried over
    assert all(n.args[1] == [64] and n.args[2].op == "get_attr" for n in fused)  # [hidden], the norm weight
    for node in fused:
        assert node.meta["val"].dtype == torch.float32 and node.meta["val"].shape == node.args[0].meta["val"].shape
    with torch.no_grad():
        for (ids, pos), ref in zip(inputs, before):
            assert torch.equal(gm(ids, pos)[0], ref)  # float32: the fused kernel is bitwise equal


class TwoNorms(torch.nn.Module):
    """torch_rmsnorm called directly: one with a weight in x's dtype, one with a weight in another dtype."""

    def __init__(self, x_dtype, other_dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.same = torch.nn.Parameter(torch.randn(16, generator=gen).to(x_dtype))
        self.other = torch.nn.Parameter(torch.randn(16, generator=gen).to(other_dtype))

    def forward(self, x):
        a = torch.ops.auto_deploy.torch_rmsnorm(x, self.same, 1e-5)
        b = torch.ops.auto_deploy.torch_rmsnorm(x, self.other, 1e-6)
        return a, b


@pytest.mark.parametrize("x_dtype,other_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_fuse_rmsnorm_leaves_mixed_dtypes_alone(x_dtype, other_dtype):
    module, x = TwoNorms(x_dtype, other_dtype), torch.randn(3, 5, 16).to(x_dtype)
    gm = export_gm(module, x, dims=BATCH, cleanup=CLEANUP)
    with torch.no_grad():
        expected = module(x)
    gm = _fuse_rmsnorm(gm)
    assert transform_history(gm)["fuse_rmsnorm"].info.num_matches == 1
    (fused,) = gm.graph.find_nodes(op="call_function", target=RMS_NORM)
    (kept,) = gm.graph.find_nodes(op="call_function", target=RMSNORM)
    assert fused.args[2].target == "same" and fused.args[3] == 1e-5
    assert kept.args[1].target == "other"  # aten.rms_norm would not give the promoted result dtype
    with torch.no_grad():
        out = gm(x)
        out5 = gm(torch.randn(5, 5, 16).to(x_dtype))  # the batch dim stays dynamic
    assert [o.dtype for o in out] == [e.dtype for e in expected] == [x_dtype, torch.float32]
    assert out5[0].shape == (5, 5, 16)
    torch.testing.assert_close(out[1], expected[1], atol=0, rtol=0)  # untouched node: same computation
    if x_dtype == torch.float32:
        torch.testing.assert_close(out[0], expected[0], atol=0, rtol=0)
    else:  # bf16: the fused kernel rounds once after the weight multiply, HF rounds before: <= 1 ulp apart
        torch.testing.assert_close(out[0], expected[0], atol=1e-5, rtol=2 ** -7)
        ref32 = module.same.detach().float() * x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        assert float((out[0].float() - ref32).abs().max()) <= 2 ** -7 * float(ref32.abs().max())


def test_fuse_rmsnorm_nothing_to_fuse():
    gm = _fuse_rmsnorm(export_gm(torch.nn.Linear(16, 16), torch.randn(3, 16), dims=BATCH, cleanup=CLEANUP))
    info = transform_history(gm)["fuse_rmsnorm"].info
    assert info.num_matches == 0 and not info.skipped


class Weightless(torch.nn.Module):
    """NanoChat's norm / Llama 4's L2 q/k norm: no weight; with ``upcast``, HF's fp32 compute and cast back."""

    def __init__(self, upcast=False, x_first=True):
        super().__init__()
        self.upcast, self.x_first = upcast, x_first

    def forward(self, x):
        h = x.to(torch.float32) if self.upcast else x
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = h * r if self.x_first else r * h
        return (h.to(x.dtype) if self.upcast else h) * 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_first", [True, False])
def test_weightless_rmsnorm(x_first, dtype):
    gm = _check(Weightless(upcast=True, x_first=x_first), torch.randn(3, 16).to(dtype), 1)
    (node,) = gm.graph.find_nodes(op="call_function", target=RMSNORM)
    assert node.args[1] is None
    fused = run_transform("fuse_rmsnorm", gm, "post_load_fusion")
    assert num_matches(fused, "fuse_rmsnorm") == 1 and count(fused, aten.rms_norm.default) == 1
    x = torch.randn(4, 16).to(dtype)
    torch.testing.assert_close(fused(x)[0], Weightless(upcast=True, x_first=x_first)(x))


def test_weightless_fp32_without_casts():
    _check(Weightless(), torch.randn(3, 16), 1)


def test_weighted_norm_keeps_its_weight():
    """The weighted forms are tried first: a weighted norm is never split into a weightless op and a multiply."""
    gm = _check(Norm(), torch.randn(3, 16, dtype=torch.bfloat16), 1)
    (node,) = gm.graph.find_nodes(op="call_function", target=RMSNORM)
    assert node.args[1] is not None


def test_weightless_low_precision_left_alone():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    gm = export_gm(Weightless(), x, dims=BATCH, cleanup=CLEANUP)  # computed in bf16, no upcast
    gm = run_transform("match_rmsnorm_pattern", gm, "pattern_matcher")
    assert _matches(gm) == 0

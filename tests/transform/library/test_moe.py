"""match_moe_pattern: op counts and numerics on small exported expert loops, then per architecture."""

import pytest
import torch
import torch.nn.functional as F

import autodeploy
from autodeploy.transform import transform_history
from helpers import count, export_gm, num_matches, run_transform
from tiny_models import hf_reference, random_batch

aten = torch.ops.aten
MOE = torch.ops.auto_deploy.torch_moe.default
RMSNORM = torch.ops.auto_deploy.torch_rmsnorm.default
MATCHERS = {
    "transforms.match_moe_pattern.stage": "pattern_matcher",
    "transforms.match_rmsnorm_pattern.stage": "pattern_matcher",
}
E, H, INTER, K = 4, 16, 8, 2
# export like the pipeline does: dynamic token count, export's assertion nodes removed
TOKENS, CLEANUP = {0: torch.export.Dim("tokens", min=2, max=64)}, ["cleanup_input_constraints"]


class Experts(torch.nn.Module):
    """A router plus the dense expert loop of the ``moe_dense_experts`` export patch, with variants."""

    def __init__(self, bias=False, transposed=False, act="silu", up_first=False, extra_column=True):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(E, H, generator=gen))
        gate_up, down = torch.randn(E, 2 * INTER, H, generator=gen) / 4, torch.randn(E, H, INTER, generator=gen) / 3
        self.gate_up = torch.nn.Parameter(gate_up.transpose(1, 2).contiguous() if transposed else gate_up)
        self.down = torch.nn.Parameter(down.transpose(1, 2).contiguous() if transposed else down)
        self.bias = torch.nn.Parameter(torch.randn(E, 2 * INTER, generator=gen)) if bias else None
        self.transposed, self.act, self.up_first, self.extra_column = transposed, act, up_first, extra_column

    def _linear(self, x, w):
        return F.linear(x, w.t() if self.transposed else w)

    def forward(self, x):
        weights, index = torch.topk(F.linear(x, self.router).softmax(-1), K)
        weights = weights / weights.sum(-1, keepdim=True)
        columns = E + 1 if self.extra_column else E
        routing = torch.zeros(x.shape[0], columns, dtype=weights.dtype, device=x.device)
        routing = routing.scatter_add(1, index.clamp(max=E) if self.extra_column else index, weights)
        out = torch.zeros_like(x)
        for e in range(E):
            h = self._linear(x, self.gate_up[e])
            if self.bias is not None:
                h = h + self.bias[e]
            gate, up = h.chunk(2, dim=-1)
            if self.up_first:
                gate, up = up, gate
            h = (F.silu(gate) if self.act == "silu" else F.gelu(gate)) * up
            h = self._linear(h, self.down[e])
            out = out + h * routing[:, e, None].to(h.dtype)
        return out.to(x.dtype)


def _matches(gm) -> int:
    return num_matches(gm, "match_moe_pattern")


@pytest.mark.parametrize("extra_column", [True, False])
@pytest.mark.parametrize("clean_noop_adds", [False, True])
def test_dense_loop_becomes_one_torch_moe(extra_column, clean_noop_adds):
    module, x = Experts(extra_column=extra_column), torch.randn(7, H)
    gm = export_gm(module, x, dims=TOKENS, cleanup=CLEANUP)
    if clean_noop_adds:  # the pipeline removes the loop's initial zeros_like + contribution
        gm = run_transform("cleanup_noop_add", gm, "post_export")
    assert count(gm, aten.silu.default) == E and count(gm, MOE) == 0
    gm = run_transform("match_moe_pattern", gm, "pattern_matcher")
    assert _matches(gm) == 1 and count(gm, MOE) == 1
    # the loop is gone, the router stays
    for target in (aten.silu.default, aten.scatter_add.default, aten.select.int, aten.chunk.default):
        assert count(gm, target) == 0, target
    assert count(gm, aten.topk.default) == 1
    (moe,) = gm.graph.find_nodes(op="call_function", target=MOE)
    assert moe.args[1].meta["val"].dtype == torch.int64 and moe.meta["val"].shape[1] == H
    with torch.no_grad():
        for tokens in (7, 13):
            x = torch.randn(tokens, H)
            torch.testing.assert_close(gm(x)[0], module(x), atol=1e-5, rtol=1e-5)


def test_bf16_loop():
    module, x = Experts().to(torch.bfloat16), torch.randn(9, H, dtype=torch.bfloat16)
    gm = run_transform("match_moe_pattern", export_gm(module, x, dims=TOKENS, cleanup=CLEANUP), "pattern_matcher")
    assert _matches(gm) == 1
    with torch.no_grad():
        out, ref = gm(x)[0], module(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "kwargs",
    [{"bias": True}, {"transposed": True}, {"act": "gelu"}, {"up_first": True}],
    ids=["bias", "transposed", "gelu", "up_first"],
)
def test_other_expert_forms_left_unmatched(kwargs):
    module, x = Experts(**kwargs), torch.randn(7, H)
    gm = export_gm(module, x, dims=TOKENS, cleanup=CLEANUP)
    before = len(gm.graph.nodes)
    gm = run_transform("match_moe_pattern", gm, "pattern_matcher")
    assert _matches(gm) == 0 and count(gm, MOE) == 0 and len(gm.graph.nodes) == before
    torch.testing.assert_close(gm(x)[0], module(x))


class MissingExpert(Experts):
    """Only experts 0..E-2 are summed: not the op's computation."""

    def forward(self, x):
        weights, index = torch.topk(F.linear(x, self.router).softmax(-1), K)
        routing = torch.zeros(x.shape[0], E + 1, dtype=weights.dtype).scatter_add(1, index.clamp(max=E), weights)
        out = torch.zeros_like(x)
        for e in range(E - 1):
            gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, self.down[e]) * routing[:, e, None]
        return out


def test_missing_expert_left_unmatched():
    gm = export_gm(MissingExpert(), torch.randn(7, H), dims=TOKENS, cleanup=CLEANUP)
    gm = run_transform("match_moe_pattern", gm, "pattern_matcher")
    assert _matches(gm) == 0 and count(gm, MOE) == 0


def test_no_moe_reports_zero():
    gm = export_gm(torch.nn.Linear(H, H), torch.randn(7, H), dims=TOKENS, cleanup=CLEANUP)
    gm = run_transform("match_moe_pattern", gm, "pattern_matcher")
    info = transform_history(gm)["match_moe_pattern"].info
    assert info.num_matches == 0 and not info.skipped


# -- per architecture ---------------------------------------------------------------------------
SHAPES = [(1, 6), (3, 5)]


def _check_arch(path, overrides, atol=1e-4, dtype=torch.float32):
    gm = autodeploy.optimize(path, until="weight_load", overrides={**MATCHERS, **overrides})
    reference = hf_reference(path).to(dtype)
    layers = reference.config.num_hidden_layers
    assert count(gm, MOE) == layers == _matches(gm)
    assert count(gm, aten.scatter_add.default) == 0 and count(gm, aten.silu.default) <= layers  # shared experts only
    assert count(gm, RMSNORM) == 2 * layers + 1 and count(gm, aten.rsqrt.default) == 0
    for batch, seq in SHAPES:
        input_ids, position_ids = random_batch(batch, seq, seed=batch + seq)
        with torch.no_grad():
            logits = gm(input_ids, position_ids)[0]
            ref = reference(input_ids=input_ids, position_ids=position_ids).logits
        assert logits.dtype == dtype
        torch.testing.assert_close(logits.float(), ref.float(), atol=atol, rtol=0)
    return gm


@pytest.mark.slow  # both MoE architectures against HF
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_architectures(arch, tiny_checkpoint):
    _check_arch(tiny_checkpoint(arch), {})


@pytest.mark.slow  # both MoE architectures against HF
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_architectures_with_few_traced_experts(arch, tiny_checkpoint):
    _check_arch(tiny_checkpoint(arch), {"transforms.export_to_gm.num_moe_experts_for_export": 2})


@pytest.mark.slow  # mixtral against HF
def test_bf16_mixtral(tiny_checkpoint):
    _check_arch(tiny_checkpoint("mixtral"), {"dtype": "bfloat16"}, atol=2e-2, dtype=torch.bfloat16)


class ZeroComputationExperts(torch.nn.Module):
    """LongCat-Flash: E SwiGLU experts and Z zero-computation (identity) experts; ``gate_up`` has rows for all
    E + Z, ``down`` for the E. The loop is the ``moe_identity_experts`` export patch's."""

    Z = 2

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(E + self.Z, H, generator=gen))
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E + self.Z, 2 * INTER, H, generator=gen) / 4)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, INTER, generator=gen) / 3)
        self.num_routed_experts, self.act_fn = E, F.silu

    def forward(self, x):
        from autodeploy.export.patches.moe import identity_experts_forward

        weights, index = torch.topk(F.linear(x, self.router).softmax(-1), K)
        return identity_experts_forward(self, x, index, weights)


def test_gate_up_with_rows_for_zero_computation_experts():
    module, x = ZeroComputationExperts(), torch.randn(9, H)
    with torch.no_grad():
        assert (torch.topk(F.linear(x, module.router), K).indices >= E).any()  # some tokens pick an identity expert
    gm = export_gm(module, x, dims=TOKENS, cleanup=CLEANUP)
    gm = run_transform("match_moe_pattern", gm, "pattern_matcher")
    assert _matches(gm) == 1 and count(gm, MOE) == 1 and count(gm, aten.silu.default) == 0
    (moe,) = gm.graph.find_nodes(op="call_function", target=MOE)
    assert tuple(moe.args[3].meta["val"].shape) == (E, 2 * INTER, H)  # the routed experts' rows of gate_up
    with torch.no_grad():
        for tokens in (9, 17):
            x = torch.randn(tokens, H)
            torch.testing.assert_close(gm(x)[0], module(x), atol=1e-5, rtol=1e-5)

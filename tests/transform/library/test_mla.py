"""match_mla_attention: op counts before/after and numerics on a small MLA graph and on tiny DeepSeek-V3 models,
negatives that must not match, and the compact cache end to end (greedy tokens identical to HF)."""

import pytest
import torch
from torch import nn

import autodeploy
from autodeploy.coverage import VOCAB, make_checkpoint
from autodeploy.runtime.kv_cache import KV_CACHE_META_KEY
from autodeploy.utils.fx import named_graphmodules
from helpers import count, export_gm, num_matches, run_transform, run_transforms

aten = torch.ops.aten
ops = torch.ops.auto_deploy
N, NOPE, ROPE, V, LORA = 4, 16, 8, 12, 32
ENABLED = {"transforms.match_mla_attention.enabled": True}


class MiniMLA(nn.Module):
    """One MLA layer as HF's DeepSeek family writes it, its attention already the canonical bsnd op.

    ``value_from``: "latent" (MLA), or "own" (values of a projection of their own: not MLA). ``window``: a sliding
    window on the attention (MLA's op has none)."""

    def __init__(self, value_from="latent", window=None):
        super().__init__()
        self.q = nn.Linear(64, N * (NOPE + ROPE), bias=False)
        self.kv_a = nn.Linear(64, LORA + ROPE, bias=False)
        self.kv_b = nn.Linear(LORA, N * (NOPE + V), bias=False)
        self.v = nn.Linear(64, N * V, bias=False)
        self.value_from, self.window = value_from, window

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, N, NOPE + ROPE).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
        latent, k_pe = torch.split(self.kv_a(x), [LORA, ROPE], dim=-1)
        kv = self.kv_b(latent.view(b, 1, s, LORA)).view(b, s, N, NOPE + V).transpose(1, 2)
        k_nope, v = torch.split(kv, [NOPE, V], dim=-1)
        if self.value_from == "own":
            v = self.v(x).view(b, s, N, V).transpose(1, 2)
        key = torch.cat((k_nope, k_pe.view(b, 1, s, ROPE).expand(-1, N, -1, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        out = ops.torch_attention(query.transpose(1, 2), key.transpose(1, 2), v.transpose(1, 2), scale=0.2,
                                  sliding_window=self.window, layout="bsnd")
        return (out.reshape(b, s, N * V),)


def _x(batch, seq, seed=0):
    return torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(seed))


_DIMS = {0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("seq", max=64)}


def test_mla_layer_becomes_one_op():
    torch.manual_seed(0)
    module = MiniMLA().eval()
    gm = export_gm(module, _x(2, 5), dims=_DIMS, strict=False)
    gm = run_transform("eliminate_redundant_transposes", gm, "pattern_matcher")
    assert count(gm, ops.torch_attention.default) == 1 and count(gm, aten.expand.default) == 1
    gm = run_transform("match_mla_attention", gm, "pattern_matcher")
    assert num_matches(gm, "match_mla_attention") == 1
    assert count(gm, ops.torch_attention.default) == 0 and count(gm, ops.torch_mla.default) == 1
    assert count(gm, aten.expand.default) == 0  # the expanded keys are gone: the op takes the latent
    (node,) = gm.graph.find_nodes(op="call_function", target=ops.torch_mla.default)
    assert [tuple(a.meta["val"].shape[2:]) for a in node.args[:4]] == [(N, NOPE), (N, ROPE), (LORA,), (ROPE,)]
    assert node.args[4].target == "kv_b.weight" and node.kwargs["scale"] == 0.2
    gm.graph.lint()
    with torch.no_grad():
        for batch, seq in ((2, 5), (1, 11)):
            torch.testing.assert_close(gm(_x(batch, seq, seq))[0], module(_x(batch, seq, seq))[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("module", [MiniMLA(value_from="own"), MiniMLA(window=4)], ids=["own_values", "window"])
def test_not_mla_left_alone(module):
    gm = export_gm(module.eval(), _x(2, 5), dims=_DIMS, strict=False)
    gm = run_transforms(gm, ["eliminate_redundant_transposes", "match_mla_attention"], "pattern_matcher")
    assert num_matches(gm, "match_mla_attention") == 0
    assert count(gm, ops.torch_attention.default) == 1 and count(gm, ops.torch_mla.default) == 0


# ------------------------------------------------------------------------------------------------
# tiny HF models
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))


def _ops(gm):
    return count(gm, ops.torch_attention.default), count(gm, ops.torch_mla.default)


def _batch(batch=2, seq=7, seed=0):
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(seq).expand(batch, seq)


def test_deepseek_v3_fp32_logits_match_hf(deepseek_v3):
    from transformers import AutoModelForCausalLM

    off = autodeploy.optimize(deepseek_v3, until="pattern_matcher")
    assert _ops(off) == (2, 0)  # off by default
    gm = autodeploy.optimize(deepseek_v3, until="post_load_fusion", overrides=ENABLED)
    assert _ops(gm) == (0, 2)
    reference = AutoModelForCausalLM.from_pretrained(deepseek_v3, dtype=torch.float32).eval()
    with torch.no_grad():
        for seed, (batch, seq) in enumerate(((2, 7), (1, 13))):
            ids, pos = _batch(batch, seq, seed)
            torch.testing.assert_close(gm(ids, pos)[0], reference(ids).logits, atol=1e-4, rtol=0)


def test_deepseek_v3_bf16_like_the_unmatched_graph(deepseek_v3):
    overrides = {"dtype": "bfloat16"}
    unmatched = autodeploy.optimize(deepseek_v3, until="post_load_fusion", overrides=overrides)
    matched = autodeploy.optimize(deepseek_v3, until="post_load_fusion", overrides={**overrides, **ENABLED})
    assert _ops(matched) == (0, 2)
    ids, pos = _batch()
    with torch.no_grad():
        out, ref = matched(ids, pos)[0], unmatched(ids, pos)[0]
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.slow  # builds the cached pipeline and generates
def test_deepseek_v3_compact_cache_generates_hf_tokens(deepseek_v3):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(deepseek_v3, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 20)]
    llm = autodeploy.LLM(deepseek_v3, max_batch_size=3, max_seq_len=64,
                         kv_cache_config={"max_tokens": 96, "page_size": 16}, overrides=ENABLED)
    with llm:
        outs = llm.generate(prompts, autodeploy.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        (spec,) = [gm.meta[KV_CACHE_META_KEY] for _, gm in named_graphmodules(llm.module)
                   if KV_CACHE_META_KEY in gm.meta]
    # two layers of (kv_lora_rank 32 + rope 8) float32 numbers per token, against 4 heads of (24 + 16) expanded
    assert spec.bytes_per_token == 2 * (32 + 8) * 4
    for prompt, out in zip(prompts, outs):
        t = torch.tensor([prompt])
        with torch.no_grad():
            hf = reference.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=20, do_sample=False,
                                    pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == hf


def test_insert_cached_attention_gives_mla_its_compact_cache():
    """torch_mla -> torch_cached_mla with caches of one latent (32) and one rope key (8) per token; prefill of two
    sequences, then a decode step of both, against the uncached layer over the whole sequences."""
    from autodeploy.transform import PipelineContext

    torch.manual_seed(0)
    module = MiniMLA().eval()
    gm = export_gm(module, _x(2, 5), dims=_DIMS, strict=False)
    gm = run_transforms(gm, ["eliminate_redundant_transposes", "match_mla_attention"], "pattern_matcher")
    ctx = PipelineContext(max_batch_size=4, max_seq_len=32)
    gm = run_transform("insert_cached_attention", gm, "cache_init", ctx, page_size=4)
    assert count(gm, ops.torch_mla.default) == 0 and count(gm, ops.torch_cached_mla.default) == 1
    (layer,) = gm.meta[KV_CACHE_META_KEY].layers
    assert (layer.n_kv_heads, layer.head_dim, layer.v_head_dim) == (1, LORA, ROPE)
    assert gm.meta[KV_CACHE_META_KEY].bytes_per_token == (LORA + ROPE) * 4  # expanded: N * (NOPE + ROPE + V) * 4
    gm = run_transform("initialize_cache", gm, "cache_init", ctx, num_pages=8)

    seqs = [_x(1, 6, seed=1), _x(1, 4, seed=2)]
    table = torch.tensor([[0, 3], [5, 1]], dtype=torch.int32)
    with torch.no_grad():
        prefill = gm(torch.cat([s[:, :-1] for s in seqs], 1), torch.tensor([5, 3], dtype=torch.int32),
                     torch.tensor([0, 0], dtype=torch.int32), table)[0]
        decode = gm(torch.cat([s[:, -1:] for s in seqs], 1), torch.tensor([1, 1], dtype=torch.int32),
                    torch.tensor([5, 3], dtype=torch.int32), table)[0]
        full = [module(s)[0] for s in seqs]
    torch.testing.assert_close(prefill, torch.cat([f[:, :-1] for f in full], 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode, torch.cat([f[:, -1:] for f in full], 1), atol=1e-5, rtol=1e-5)

"""Attention matchers: op counts before/after and numerics on hand-built graphs, then per architecture
(all six transforms, in pipeline order) against HF."""

import pytest
import torch
import torch.nn.functional as F

import autodeploy
import autodeploy.custom_ops  # noqa: F401
from autodeploy.transform import transform_history
from helpers import count, export_gm, num_matches, run_transform, run_transforms
from tiny_models import ARCHS, hf_reference, random_batch

aten = torch.ops.aten
ad = torch.ops.auto_deploy
KEYS = [
    "match_repeat_kv",
    "match_eager_attention",
    "match_sdpa_to_torch_attention",
    "match_grouped_attention",
    "match_attention_layout",
    "eliminate_redundant_transposes",
]
OVERRIDES = {f"transforms.{key}.stage": "pattern_matcher" for key in KEYS}
# export: dynamic batch and sequence dims of the [b, n, s, d] inputs, then the post_export clean-ups the
# pipeline runs first (export's assertion nodes, no-op slices/casts)
BNSD = {0: torch.export.Dim("batch", min=1, max=16), 2: torch.export.Dim("seq", min=2, max=64)}
CLEANUP = ("cleanup_noop_slice", "cleanup_noop_to", "cleanup_input_constraints")


# ------------------------------------------------------------------------------------------------
# hand-built graphs
# ------------------------------------------------------------------------------------------------
def _repeat_kv(x, n_rep):  # HF's
    b, n, s, d = x.shape
    return x[:, :, None, :, :].expand(b, n, n_rep, s, d).reshape(b, n * n_rep, s, d)


def _qkv(b=2, s=6, n=4, n_kv=2, d=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=gen).to(dtype) for h in (n, n_kv, n_kv))


def _causal_additive(q):
    s = q.shape[2]
    keep = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    return torch.zeros(s, s, dtype=q.dtype, device=q.device).masked_fill(~keep, torch.finfo(q.dtype).min)


class Eager(torch.nn.Module):
    """HF eager attention (llama / gemma2 / gpt-oss variants)."""

    def __init__(self, softcap=None, sinks=False, mask=True, n=4):
        super().__init__()
        self.softcap, self.mask = softcap, mask
        self.sinks = torch.nn.Parameter(torch.randn(n)) if sinks else None

    def forward(self, q, k, v):
        k, v = _repeat_kv(k, 2), _repeat_kv(v, 2)
        w = torch.matmul(q, k.transpose(2, 3)) * 0.3
        if self.softcap is not None:
            w = torch.tanh(w / self.softcap) * self.softcap
        if self.mask:
            w = w + _causal_additive(q)
        if self.sinks is not None:
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
            w = torch.cat([w, sinks], dim=-1)
            w = w - w.max(dim=-1, keepdim=True).values
            p = F.softmax(w, dim=-1, dtype=w.dtype)[..., :-1]
            p = F.dropout(p, p=0.0, training=False).to(v.dtype)
        else:
            p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            p = F.dropout(p, p=0.0, training=False)
        return torch.matmul(p, v).transpose(1, 2).contiguous()


class Sdpa(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, q, k, v):
        if self.mode == "gqa":  # enable_gqa, no mask
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = _repeat_kv(k, 2), _repeat_kv(v, 2)
            s = q.shape[2]
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None].expand(q.shape[0], 1, s, s)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
        out = out.reshape(out.shape[0], -1, q.shape[2], v.shape[-1])  # HF's pack_gqa undo (a no-op)
        return out.transpose(1, 2).contiguous()


def test_repeat_kv_matched_other_expands_kept():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            other = q[:, :, None].expand(-1, -1, 3, -1, -1).sum(2)  # unsqueeze/expand, no reshape: kept
            return _repeat_kv(k, 2) + q, _repeat_kv(v, 2) * 2, other

    args = _qkv()
    gm = export_gm(M(), *args, dims=BNSD, strict=False, cleanup=CLEANUP)
    expected = gm(*args)
    assert count(gm, aten.expand.default) == 3
    gm = run_transform("match_repeat_kv", gm, "pattern_matcher")
    assert num_matches(gm, "match_repeat_kv") == 2
    assert count(gm, ad.torch_repeat_kv.default) == 2 and count(gm, aten.expand.default) == 1
    for out, ref in zip(gm(*args), expected):
        torch.testing.assert_close(out, ref)
    args5 = _qkv(b=3, s=5, seed=1)  # still dynamic
    torch.testing.assert_close(gm(*args5)[0], _repeat_kv(args5[1], 2) + args5[0])


@pytest.mark.parametrize(
    "variant",
    [dict(), dict(mask=False), dict(softcap=5.0), dict(sinks=True)],
    ids=["mask", "nomask", "softcap", "sinks"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_attention_matched(variant, dtype):
    torch.manual_seed(0)
    module = Eager(**variant).to(dtype)
    args = _qkv(dtype=dtype)
    gm = export_gm(module, *args, dims=BNSD, strict=False, cleanup=CLEANUP)
    expected = module(*args)
    gm = run_transforms(gm, ["match_repeat_kv", "match_eager_attention"], "pattern_matcher")
    assert num_matches(gm, "match_eager_attention") == 1
    assert count(gm, aten.matmul.default) == 0 and count(gm, aten.softmax.int) == 0
    assert count(gm, aten.dropout.default) == 0
    (node,) = gm.graph.find_nodes(op="call_function", target=ad.torch_attention.default)
    assert node.kwargs["scale"] == pytest.approx(0.3)
    assert node.kwargs["logit_cap"] == variant.get("softcap")
    assert (node.kwargs["sinks"] is not None) == bool(variant.get("sinks"))
    assert node.kwargs["is_causal"] == variant.get("mask", True)  # no mask in the graph: not causal
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(gm(*args)[0], expected, **tol)
    # the rest of the chain
    rest = ["match_grouped_attention", "match_attention_layout", "eliminate_redundant_transposes"]
    gm = run_transforms(gm, rest, "pattern_matcher")
    assert count(gm, ad.torch_repeat_kv.default) == 0
    args7 = _qkv(b=1, s=7, seed=2, dtype=dtype)
    torch.testing.assert_close(gm(*args7)[0], module(*args7), **tol)


def test_eager_attention_needs_the_whole_chain():
    class NotAttention(torch.nn.Module):  # softmax over dim 1 and a use of the scores outside
        def forward(self, q, k, v):
            w = torch.matmul(q, k.transpose(2, 3)) * 0.3
            return torch.matmul(F.softmax(w, dim=1), v), w

    gm = export_gm(NotAttention(), *_qkv(n_kv=4), dims=BNSD, strict=False, cleanup=CLEANUP)
    gm = run_transform("match_eager_attention", gm, "pattern_matcher")
    assert num_matches(gm, "match_eager_attention") == 0
    assert count(gm, aten.matmul.default) == 2


@pytest.mark.parametrize("mode", ["gqa", "mask"])
def test_sdpa_grouped_layout_transposes(mode):
    module = Sdpa(mode)
    args = _qkv()
    gm = export_gm(module, *args, dims=BNSD, strict=False, cleanup=CLEANUP)
    expected = module(*args)
    transposes = count(gm, aten.transpose.int)

    gm = run_transforms(gm, ["match_repeat_kv", "match_sdpa_to_torch_attention"], "pattern_matcher")
    assert num_matches(gm, "match_sdpa_to_torch_attention") == 1
    assert count(gm, aten.scaled_dot_product_attention.default) == 0
    (node,) = gm.graph.find_nodes(op="call_function", target=ad.torch_attention.default)
    assert node.kwargs["attn_mask"] is None and node.kwargs["is_causal"]
    assert node.kwargs["scale"] == (0.25 if mode == "mask" else None)
    torch.testing.assert_close(gm(*args)[0], expected)

    gm = run_transform("match_grouped_attention", gm, "pattern_matcher")
    assert num_matches(gm, "match_grouped_attention") == (1 if mode == "mask" else 0)
    assert count(gm, ad.torch_repeat_kv.default) == 0
    torch.testing.assert_close(gm(*args)[0], expected)

    gm = run_transform("match_attention_layout", gm, "pattern_matcher")
    assert num_matches(gm, "match_attention_layout") == 1
    (node,) = gm.graph.find_nodes(op="call_function", target=ad.torch_attention.default)
    assert node.kwargs["layout"] == "bsnd"
    assert count(gm, aten.transpose.int) == transposes + 4
    assert node.meta["val"].shape[1] == node.args[0].meta["val"].shape[1]  # shapes current: [b, s, n, d]
    torch.testing.assert_close(gm(*args)[0], expected)

    gm = run_transform("eliminate_redundant_transposes", gm, "pattern_matcher")
    # the output transpose pair cancels (through the no-op reshape); q/k/v come in as graph inputs
    assert num_matches(gm, "eliminate_redundant_transposes") == 1
    assert count(gm, aten.transpose.int) == transposes + 2
    torch.testing.assert_close(gm(*args)[0], expected)
    args9 = _qkv(b=3, s=9, seed=3)
    torch.testing.assert_close(gm(*args9)[0], module(*args9))


def test_redundant_transposes_only_cancelling_pairs():
    class M(torch.nn.Module):
        def forward(self, x, y, z):
            a = x.transpose(1, 2).transpose(2, 1)  # cancels
            b = y.transpose(1, 2).transpose(1, 3)  # does not
            c = z.transpose(-3, 2).reshape(z.shape[0], z.shape[2], z.shape[1], -1).transpose(1, 2)  # cancels
            return a * 2, b + 1, c.contiguous().view(z.shape[0], -1)

    args = _qkv(n_kv=4)
    gm = export_gm(M(), *args, dims=BNSD, strict=False, cleanup=CLEANUP)
    expected = gm(*args)
    assert count(gm, aten.transpose.int) == 6
    gm = run_transform("eliminate_redundant_transposes", gm, "pattern_matcher")
    assert num_matches(gm, "eliminate_redundant_transposes") == 2
    assert count(gm, aten.transpose.int) == 2
    for out, ref in zip(gm(*args), expected):
        torch.testing.assert_close(out, ref)


def test_no_attention_no_matches():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return q + 1, k, v

    gm = run_transforms(export_gm(M(), *_qkv(), dims=BNSD, strict=False, cleanup=CLEANUP), KEYS, "pattern_matcher")
    for key in KEYS:
        info = transform_history(gm)[key].info
        assert info.num_matches == 0 and not info.skipped


# ------------------------------------------------------------------------------------------------
# architectures
# ------------------------------------------------------------------------------------------------
SHAPES = [(1, 1), (2, 9)]


def _check_model(path, overrides=None, layers=2, atol=1e-4, dtype=torch.float32):
    gm = autodeploy.optimize(path, until="weight_load", overrides={**OVERRIDES, **(overrides or {})})
    attention = gm.graph.find_nodes(op="call_function", target=ad.torch_attention.default)
    assert len(attention) == layers
    assert all(n.kwargs["layout"] == "bsnd" for n in attention)
    assert count(gm, aten.scaled_dot_product_attention.default) == 0
    assert count(gm, ad.torch_repeat_kv.default) == 0
    assert not [n for n in gm.graph.find_nodes(op="call_function", target=aten.softmax.int) if n.meta["val"].dim() == 4]
    reference = hf_reference(path)
    for batch, seq in SHAPES:
        input_ids, position_ids = random_batch(batch, seq, seed=batch * 100 + seq)
        with torch.no_grad():
            logits = gm(input_ids, position_ids)[0]
            expected = reference(input_ids=input_ids, position_ids=position_ids).logits
        assert logits.dtype == dtype
        torch.testing.assert_close(logits.float(), expected, atol=atol, rtol=0)
    return gm, attention


@pytest.mark.slow  # every architecture against HF
@pytest.mark.parametrize("arch", ARCHS)
def test_architectures_sdpa(arch, tiny_checkpoint):
    gm, _ = _check_model(tiny_checkpoint(arch))
    assert num_matches(gm, "match_sdpa_to_torch_attention") == 2
    assert num_matches(gm, "match_grouped_attention") == 2


@pytest.mark.slow  # llama against HF
def test_eager_llama(tiny_checkpoint):
    gm, _ = _check_model(tiny_checkpoint("llama"), {"model_kwargs._attn_implementation": "eager"})
    assert num_matches(gm, "match_eager_attention") == 2
    assert num_matches(gm, "match_sdpa_to_torch_attention") == 0


@pytest.mark.slow  # llama against HF
def test_bf16_llama(tiny_checkpoint):
    gm, _ = _check_model(tiny_checkpoint("llama"), {"dtype": "bfloat16"}, atol=0.1, dtype=torch.bfloat16)
    assert num_matches(gm, "match_repeat_kv") == 4


@pytest.mark.slow  # qwen2 against HF
def test_eager_bf16_qwen2(tiny_checkpoint):
    gm, _ = _check_model(
        tiny_checkpoint("qwen2"), {"dtype": "bfloat16", "model_kwargs._attn_implementation": "eager"},
        atol=0.1, dtype=torch.bfloat16,
    )
    assert num_matches(gm, "match_eager_attention") == 2


@pytest.mark.slow  # mistral against HF
def test_mistral_sliding_window(tiny_checkpoint):
    _, attention = _check_model(tiny_checkpoint("mistral", sliding_window=4))
    assert [n.kwargs["sliding_window"] for n in attention] == [4, 4]


def _save(path, config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


_SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, sliding_window=4)


@pytest.mark.slow  # gemma2 against HF
def test_gemma2_softcap_and_sliding_window(tmp_path):
    from transformers import Gemma2Config

    path = _save(tmp_path, Gemma2Config(**_SMALL, intermediate_size=96, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=None, initializer_range=0.2))
    gm, attention = _check_model(path)
    assert num_matches(gm, "match_eager_attention") == 2
    assert [n.kwargs["sliding_window"] for n in attention] == [4, None]  # layer_types: sliding, full
    assert [n.kwargs["logit_cap"] for n in attention] == [2.0, 2.0]


@pytest.mark.slow  # gpt-oss against HF
def test_gpt_oss_sinks(tmp_path):
    from transformers import GptOssConfig

    path = _save(tmp_path, GptOssConfig(**_SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                        initializer_range=0.2))
    gm, attention = _check_model(path)
    assert num_matches(gm, "match_eager_attention") == 2
    assert all(n.kwargs["sinks"] is not None for n in attention)
    assert [n.kwargs["sliding_window"] for n in attention] == [4, None]

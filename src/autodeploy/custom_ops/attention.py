"""``auto_deploy::torch_attention``: causal grouped-query attention (and ``torch_repeat_kv``, below).

    torch_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=True, scale=None,
                    sinks=None, sliding_window=None, logit_cap=None, layout="bnsd", alibi_slopes=None) -> Tensor

- ``layout="bnsd"``: query [batch, n_heads, seq, head_dim], key/value [batch, n_kv_heads, kv_seq, d];
  ``layout="bsnd"``: query [batch, seq, n_heads, head_dim], key/value [batch, kv_seq, n_kv_heads, d]
  (the canonical layout after ``match_attention_layout``). The output has the query's layout.
- n_heads must be a multiple of n_kv_heads (no repeat_kv needed).
- ``is_causal``: query i attends to keys j <= i + (kv_seq - seq) (bottom-right aligned, as for a
  query block at the end of the cached sequence).
- ``scale``: default 1/sqrt(head_dim). ``sliding_window``: keys with i - j >= window are masked.
- ``logit_cap``: scores become cap * tanh(scores / cap) (soft-capping, Gemma-2 style).
- ``sinks``: per-head logits [n_heads] that join the softmax normalizer but carry no value
  (attention sinks, gpt-oss style).
- ``alibi_slopes``: per-head slopes [n_heads] of ALiBi (bloom, mpt): scores get
  ``slopes[h] * (j - i)`` for query position i and key position j, computed here from the positions (so the
  cached attention computes the same bias from cache positions). HF adds ``slopes[h] * j`` (plus a constant
  per row): the same softmax.
- ``attn_mask``: optional additive float or boolean (True = keep) mask broadcastable to
  [batch, n_heads, seq, kv_seq], applied on top of the causal/sliding-window masks.
"""

from __future__ import annotations

import math

import torch

from .compile_forms import register_compile_form


def alibi_bias(slopes: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """The ALiBi bias [n_heads, *distance.shape] (float32): ``slopes[h] * distance`` (key minus query position)."""
    return slopes.float().reshape(-1, *([1] * distance.dim())) * distance.float()


def _to_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "bsnd" else t


@torch.library.custom_op("auto_deploy::torch_attention", mutates_args=())
def torch_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = True,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    layout: str = "bnsd",
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    if layout not in ("bnsd", "bsnd"):
        raise ValueError(f"torch_attention: layout must be 'bnsd' or 'bsnd', got {layout!r}")
    q, k, v = (_to_bnsd(t, layout) for t in (query, key, value))
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads % n_kv_heads:
        raise ValueError(f"torch_attention: {n_heads} query heads are not a multiple of {n_kv_heads} kv heads")
    groups = n_heads // n_kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if logit_cap is not None and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)

    seq, kv_seq = q.shape[2], k.shape[2]
    rows = torch.arange(seq, device=q.device)[:, None] + (kv_seq - seq)
    cols = torch.arange(kv_seq, device=q.device)[None, :]
    keep = torch.ones(seq, kv_seq, dtype=torch.bool, device=q.device)
    if is_causal:
        keep &= cols <= rows
    if sliding_window is not None and sliding_window > 0:
        keep &= (rows - cols) < sliding_window
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, cols - rows)
    scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()

    if sinks is not None:
        sink_logits = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, seq, 1)
        scores = torch.cat([scores, sink_logits], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :kv_seq]
    else:
        probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    out = torch.matmul(probs.to(v.dtype), v)
    return out.transpose(1, 2).contiguous() if layout == "bsnd" else out


@torch_attention.register_fake
def _torch_attention_fake(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=True, scale=None,
                          sinks=None, sliding_window=None, logit_cap=None, layout="bnsd", alibi_slopes=None):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


def repeat_kv_reference(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF's ``repeat_kv``: [batch, n_kv_heads, seq, d] -> [batch, n_kv_heads * n_rep, seq, d], each kv
    head repeated ``n_rep`` times in place (``repeat_interleave`` on dim 1).

    An intermediate canonical op: ``match_repeat_kv`` produces it, ``match_grouped_attention`` folds it
    into ``torch_attention`` (which takes the un-repeated k/v).
    """
    return hidden_states.repeat_interleave(n_rep, dim=1) if n_rep > 1 else hidden_states.clone()


torch_repeat_kv = torch.library.custom_op("auto_deploy::torch_repeat_kv", repeat_kv_reference, mutates_args=())
register_compile_form(torch.ops.auto_deploy.torch_repeat_kv.default, lambda decode: repeat_kv_reference)


@torch_repeat_kv.register_fake
def _torch_repeat_kv_fake(hidden_states, n_rep):
    b, n, s, d = hidden_states.shape
    return hidden_states.new_empty(b, n * n_rep, s, d)

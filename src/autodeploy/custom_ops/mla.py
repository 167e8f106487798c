"""Multi-head latent attention (MLA: DeepSeek-V2/V3, MiniCPM3, ...) and its compact paged cache.

    torch_mla(q_nope, q_pe, kv_latent, k_pe, kv_b_weight, scale=None) -> Tensor
    torch_cached_mla(q_nope, q_pe, kv_latent, k_pe, kv_b_weight, latent_cache, pe_cache, seq_lens, input_pos,
                     page_table, scale=None) -> Tensor

Layout "bsnd": ``q_nope`` [b, s, n, nope] and ``q_pe`` [b, s, n, rope] (the query's parts without and with the
rotary embedding, already applied), ``kv_latent`` [b, s, kv_lora_rank] (the normalized compressed kv, before
``kv_b_proj``), ``k_pe`` [b, s, rope] (the roped key part every head shares), ``kv_b_weight``
[n * (nope + v_head_dim), kv_lora_rank] (``kv_b_proj``, no bias). Per head, the key is
``cat(k_nope, k_pe)`` and the value ``v`` with ``k_nope, v = split(kv_latent @ kv_b_weight.T, [nope, v_head_dim])``;
the attention is causal with ``scale`` (default 1/sqrt(nope + rope)). Output [b, s, n, v_head_dim].

The cached form caches per token only what the keys and values are made from: the latent and the rope key
(``kv_lora_rank + rope`` numbers, against ``n * (nope + rope + v_head_dim)`` for the expanded K/V), in two paged
caches [num_pages, page_size, 1, kv_lora_rank] and [num_pages, page_size, 1, rope] with the conventions of
``torch_cached_attention`` (:mod:`.cached_attention`: flattened token stream, ``seq_lens``, ``input_pos``,
``page_table``). A fresh prompt expands its own latents to keys and values; tokens after a cached prefix
(decode, later prompt chunks) attend over the cached latents directly, ``kv_b_proj`` absorbed into the query and
the output (DeepSeek-V2's inference form), so the cache is never expanded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .cached_attention import _gather_pages, write_kv_cache_reference
from .compile_forms import register_compile_form


def _dims(q_nope: torch.Tensor, kv_b_weight: torch.Tensor) -> tuple[int, int, int]:
    """(heads, nope, v_head_dim) from the query and the kv_b_proj weight."""
    n_heads, nope = q_nope.shape[-2], q_nope.shape[-1]
    per_head = kv_b_weight.shape[0] // n_heads
    if per_head * n_heads != kv_b_weight.shape[0] or per_head <= nope:
        raise ValueError(f"torch_mla: kv_b_weight of {kv_b_weight.shape[0]} rows does not hold {n_heads} heads of "
                         f"{nope} key features plus value features")
    return n_heads, nope, per_head - nope


def _expand(kv_latent, k_pe, kv_b_weight, n_heads, nope):
    """Keys [..., n, nope + rope] and values [..., n, v] of the latents [..., lora] and rope keys [..., rope]."""
    kv = F.linear(kv_latent, kv_b_weight).unflatten(-1, (n_heads, -1))
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = torch.cat((k_nope, k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], k_pe.shape[-1])), dim=-1)
    return k, v


def _scale(scale, nope: int, rope: int) -> float:
    return 1.0 / math.sqrt(nope + rope) if scale is None else scale


def mla_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_latent: torch.Tensor, k_pe: torch.Tensor,
                  kv_b_weight: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::torch_mla`` (also its compile form)."""
    n_heads, nope, _ = _dims(q_nope, kv_b_weight)
    k, v = _expand(kv_latent, k_pe, kv_b_weight, n_heads, nope)
    q = torch.cat((q_nope, q_pe), dim=-1)
    q, k, v = (t.transpose(1, 2).to(q.dtype) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=_scale(scale, nope, q_pe.shape[-1]))
    return out.transpose(1, 2).contiguous()


torch_mla = torch.library.custom_op("auto_deploy::torch_mla", mla_reference, mutates_args=())
register_compile_form(torch.ops.auto_deploy.torch_mla.default, lambda decode: mla_reference)


@torch_mla.register_fake
def _torch_mla_fake(q_nope, q_pe, kv_latent, k_pe, kv_b_weight, scale=None):
    _, _, v_dim = _dims(q_nope, kv_b_weight)
    return q_nope.new_empty(*q_nope.shape[:-1], v_dim)


def _attend_absorbed(q_nope, q_pe, latent, pe, kv_b_weight, start_pos: int, scale: float) -> torch.Tensor:
    """Attention of ``q_nope``/``q_pe`` [L, n, *] at positions start_pos.. over the cached ``latent`` [T, lora] and
    ``pe`` [T, rope] without expanding them: kv_b_proj's key part folds into the query (``q_nope @ W_uk`` scores
    against the latents) and its value part applies once to the attended latent. Per new token this costs
    n * T * (lora + rope) multiply-adds for the scores, against T * lora * n * (nope + v) to expand T keys and
    values."""
    n_heads, nope = q_nope.shape[-2], q_nope.shape[-1]
    w = kv_b_weight.view(n_heads, -1, kv_b_weight.shape[-1])  # [n, nope + v, lora]
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_latent = torch.einsum("lnd,ndc->nlc", q_nope, w_uk.to(q_nope.dtype))
    scores = (q_latent @ latent.T.to(q_nope.dtype) + q_pe.transpose(0, 1) @ pe.T.to(q_pe.dtype)).float() * scale
    rows = torch.arange(q_nope.shape[0], device=q_nope.device)[:, None] + start_pos
    scores = scores.masked_fill(torch.arange(latent.shape[0], device=q_nope.device)[None, :] > rows, float("-inf"))
    out_latent = scores.softmax(-1).to(q_nope.dtype) @ latent.to(q_nope.dtype)  # [n, L, lora]
    return torch.einsum("nlc,nvc->lnv", out_latent, w_uv.to(q_nope.dtype))


def _attend_sequence(q, k, v, start_pos: int, scale: float) -> torch.Tensor:
    """``q`` [L, n, d] of the tokens at start_pos.. over keys/values [start_pos + L, n, *] (causal)."""
    num_new, kv_len = q.shape[0], k.shape[0]
    rows = torch.arange(num_new, device=q.device)[:, None] + start_pos
    keep = torch.arange(kv_len, device=q.device)[None, :] <= rows
    q, k, v = (t.transpose(0, 1).to(q.dtype) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    return out.transpose(0, 1)


@torch.library.custom_op("auto_deploy::torch_cached_mla", mutates_args=("latent_cache", "pe_cache"))
def torch_cached_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    latent_cache: torch.Tensor,
    pe_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    page_table: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    n_heads, nope, v_dim = _dims(q_nope, kv_b_weight)
    lora, rope = kv_latent.shape[-1], k_pe.shape[-1]
    q = torch.cat((q_nope, q_pe), dim=-1).reshape(-1, n_heads, nope + rope)
    latent, pe = kv_latent.reshape(-1, 1, lora), k_pe.reshape(-1, 1, rope)
    seq_lens, input_pos, page_table = seq_lens.long(), input_pos.long(), page_table.long()
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    write_kv_cache_reference(latent, pe, latent_cache, pe_cache, seq_lens, input_pos, page_table)
    scale = _scale(scale, nope, rope)
    page_size = latent_cache.shape[1]
    out = q.new_empty(q.shape[0], n_heads, v_dim)
    for s, (start, length, pos) in enumerate(zip(starts.tolist(), seq_lens.tolist(), input_pos.tolist())):
        if not length:
            continue
        tokens = slice(start, start + length)
        if pos == 0:  # a fresh prompt: expand its own latents (as many keys as queries), attend with SDPA
            k, v = _expand(latent[tokens, 0].to(q.dtype), pe[tokens, 0].to(q.dtype), kv_b_weight, n_heads, nope)
            out[tokens] = _attend_sequence(q[tokens], k, v, 0, scale)
            continue
        kv_len = pos + length  # decode or a later chunk: attend over the cached latents as they are
        pages = page_table[s, : -(-kv_len // page_size)].clamp_min(0)
        seq_latent = _gather_pages(latent_cache, pages).reshape(-1, lora)[:kv_len]
        seq_pe = _gather_pages(pe_cache, pages).reshape(-1, rope)[:kv_len]
        out[tokens] = _attend_absorbed(q[tokens, :, :nope], q[tokens, :, nope:], seq_latent, seq_pe, kv_b_weight, pos,
                                       scale)
    return out.to(q_nope.dtype).reshape(*q_nope.shape[:-1], v_dim)


@torch_cached_mla.register_fake
def _torch_cached_mla_fake(q_nope, q_pe, kv_latent, k_pe, kv_b_weight, latent_cache, pe_cache, seq_lens, input_pos,
                           page_table, scale=None):
    _, _, v_dim = _dims(q_nope, kv_b_weight)
    return q_nope.new_empty(*q_nope.shape[:-1], v_dim)

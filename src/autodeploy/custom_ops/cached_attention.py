"""Cached attention over a paged KV cache, and the registry of its backends.

    torch_cached_attention(q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table,
                           scale=None, sinks=None, sliding_window=None, logit_cap=None,
                           alibi_slopes=None) -> Tensor

One call serves a batch of sequences flattened into one token stream (prefill and decode mixed):

- ``q`` [..., n_heads, head_dim], ``k``/``v`` [..., n_kv_heads, head_dim] in layout "bsnd"; the
  leading dims are flattened to the token stream (normally [1, total_tokens]), sequence after sequence.
- ``k_cache``/``v_cache`` [num_pages, page_size, n_kv_heads, head_dim]: the paged cache of this layer.
  The op writes the new k/v into it (``mutates_args``) and attends over the cached prefix plus the new
  tokens.
- ``seq_lens`` [num_seqs] int32: new tokens of each sequence in this call (1 for a decode step).
- ``input_pos`` [num_seqs] int32: cache position of each sequence's first new token (tokens already
  cached; 0 for a fresh prefill).
- ``page_table`` [num_seqs, max_pages_per_seq] int32: the cache pages of each sequence, in order;
  token at position p lives in page ``page_table[s, p // page_size]``, slot ``p % page_size``. Entries
  past the pages a sequence needs are ignored (pad with anything, e.g. -1).
- ``scale``, ``sinks``, ``sliding_window``, ``logit_cap``, ``alibi_slopes``: as for
  ``auto_deploy::torch_attention``; the ALiBi bias comes from the cache positions of query and key.
  Masking is causal: new token i of a sequence (position ``input_pos + i``) sees positions ``<= it``.

Output: [..., n_heads, head_dim] like ``q``. Grouped-query attention passes k/v un-repeated (SDPA's
``enable_gqa``, or query heads folded into the rows of one matmul per kv head).

Backends are registered in :data:`ATTENTION_BACKENDS` (``register_attention_backend``); the transform
``insert_cached_attention`` picks one by name (its ``backend:`` field). ``"torch"`` (this module) is the
default: plain torch, CPU-friendly: torch's fused SDPA (flash kernel on CPU, GQA via ``enable_gqa``) per
sequence, and one padded SDPA call over all sequences for decode-only batches; sinks and soft-capping
(and ALiBi) take an explicit matmul/softmax path that folds the query heads of a kv head into one batched matmul.
Where the native kernels run (float32, head sizes whole vectors, none of those extras), decode-only batches take
``auto_deploy::decode_attention`` over the cache in place, and a fresh sequence's prompt (no cached prefix, no
window) ``auto_deploy::prefill_attention`` in place of SDPA; the new k/v go into the cache through
``auto_deploy::write_kv_cache`` (one native call where a dozen torch ops compute the slots for ``index_copy_``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import native
from .attention import alibi_bias
from .rope import rope_reference


def write_kv_cache_reference(k, v, k_cache, v_cache, seq_lens, input_pos, page_table) -> None:
    """``auto_deploy::write_kv_cache``: scatter the new tokens' k/v (``k`` / ``v`` [T, n_kv, d], the sequences'
    tokens one after another) into their (page, slot) of the paged caches (one ``index_copy_`` each into the flat
    [pages * page_size, n_kv, d] view). The plain-torch implementation; the native one copies the same rows."""
    num_tokens = k.shape[0]
    page_size = k_cache.shape[1]
    seq_lens, input_pos, page_table = seq_lens.long(), input_pos.long(), page_table.long()
    if num_tokens == seq_lens.numel():  # one token per sequence (decode): no expansion needed
        pos = input_pos
        page = page_table.gather(1, (pos // page_size)[:, None])[:, 0]
    else:
        device = k.device
        starts = torch.cumsum(seq_lens, 0) - seq_lens
        seq_idx = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=device), seq_lens,
                                          output_size=num_tokens)
        pos = input_pos[seq_idx] + (torch.arange(num_tokens, device=device) - starts[seq_idx])
        page = page_table[seq_idx, pos // page_size]
    slots = page * page_size + pos % page_size
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


_WRITE_LIB = torch.library.Library("auto_deploy", "FRAGMENT")
_WRITE_LIB.define("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor seq_lens, "
                  "Tensor input_pos, Tensor page_table) -> ()")
_WRITE_LIB.impl("write_kv_cache", write_kv_cache_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::write_kv_cache", lib=_WRITE_LIB)
def _write_kv_cache_fake(k, v, k_cache, v_cache, seq_lens, input_pos, page_table) -> None:
    return None


def _write_cache(k, v, k_cache, v_cache, seq_lens, input_pos, page_table) -> None:
    """The new tokens' k/v into the paged caches: the native copy where it takes them, else plain torch."""
    if native.write_kv_cache_available() and native.write_kv_cache_takes(k, v, k_cache, v_cache):
        torch.ops.auto_deploy.write_kv_cache(k, v, k_cache, v_cache, seq_lens, input_pos, page_table)
    else:
        write_kv_cache_reference(k, v, k_cache, v_cache, seq_lens, input_pos, page_table)


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``cache[pages]`` as one ``index_select`` over whole pages ([*pages.shape, page_size, n_kv, d]);
    cheaper than advanced indexing, which goes element-row by element-row."""
    flat = cache.view(cache.shape[0], -1).index_select(0, pages.reshape(-1))
    return flat.view(*pages.shape, *cache.shape[1:])


def _token_rows(q, k, v):
    """q/k/v with their leading dims flattened into the token stream: [tokens, heads, head_dim]."""
    return (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))


def _use_sdpa(sinks, logit_cap, alibi_slopes=None) -> bool:
    """torch's fused SDPA (flash kernel on CPU, GQA without repeating k/v) covers everything but
    attention sinks, logit soft-capping and ALiBi, which take the explicit matmul/softmax path."""
    return sinks is None and alibi_slopes is None and not (logit_cap is not None and logit_cap > 0)


def _scores_epilogue(scores, logit_cap):
    if logit_cap is not None and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    return scores


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None, groups_view: tuple[int, ...]) -> torch.Tensor:
    """Softmax over the last dim; ``sinks`` [n_heads] join the normalizer (reshaped to ``groups_view``)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    kv_len = scores.shape[-1]
    sink = sinks.float().reshape(groups_view).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :kv_len]


def _decode_keep(max_len: int, kv_lens, input_pos, sliding_window) -> torch.Tensor:
    """[num_seqs, max_len] bool: which gathered cache slots each decoding sequence may attend to."""
    cols = torch.arange(max_len, device=kv_lens.device)
    keep = cols[None, :] < kv_lens[:, None]
    if sliding_window is not None and sliding_window > 0:
        keep &= (input_pos[:, None] - cols[None, :]) < sliding_window
    return keep


def _attend_gathered(q, keys, values, keep, scale, sinks, logit_cap, alibi_slopes=None, input_pos=None):
    """Explicit matmul/softmax attention of one new token per sequence over its gathered cache slots.

    ``q`` [num_seqs, n_heads, d], ``keys``/``values`` [num_seqs, max_len, n_kv, d], ``keep`` [num_seqs,
    max_len] bool. The query heads of a kv head are folded into the rows of one batched matmul (no k/v
    repeat); sinks, soft-capping and ALiBi (from the query's ``input_pos``) are applied here."""
    num_seqs, n_heads, head_dim = q.shape
    max_len, n_kv = keys.shape[1], keys.shape[2]
    groups = n_heads // n_kv
    qg = q.reshape(num_seqs * n_kv, groups, head_dim)
    kt = keys.permute(0, 2, 3, 1).reshape(num_seqs * n_kv, head_dim, max_len)
    scores = _scores_epilogue(torch.bmm(qg, kt.to(q.dtype)).float() * scale, logit_cap)
    scores = scores.view(num_seqs, n_kv, groups, max_len)
    if alibi_slopes is not None:
        distance = torch.arange(max_len, device=q.device)[None, :] - input_pos[:, None]  # [num_seqs, max_len]
        scores = scores + alibi_bias(alibi_slopes, distance).transpose(0, 1).reshape(num_seqs, n_kv, groups, max_len)
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    probs = _softmax(scores, sinks, (1, n_kv, groups, 1))
    vv = values.permute(0, 2, 1, 3).reshape(num_seqs * n_kv, max_len, -1)
    out = torch.bmm(probs.reshape(num_seqs * n_kv, groups, max_len).to(vv.dtype), vv)
    return out.reshape(num_seqs, n_heads, -1)


def _attend_decode(q, k_cache, v_cache, input_pos, page_table, scale, sinks, sliding_window, logit_cap,
                   alibi_slopes=None):
    """Every sequence has one new token: one padded batched attention over all sequences."""
    num_seqs, n_heads, head_dim = q.shape
    _, page_size, n_kv, _ = k_cache.shape
    groups = n_heads // n_kv
    kv_lens = input_pos + 1
    shortest, longest = torch.stack([kv_lens.min(), kv_lens.max()]).tolist()  # one host sync
    num_pages = -(-longest // page_size)
    pages = page_table[:, :num_pages].clamp_min(0)
    max_len = num_pages * page_size
    keys = _gather_pages(k_cache, pages).view(num_seqs, max_len, n_kv, head_dim)  # copy of the used pages
    values = _gather_pages(v_cache, pages).view(num_seqs, max_len, n_kv, v_cache.shape[-1])
    windowed = sliding_window is not None and sliding_window > 0
    if _use_sdpa(sinks, logit_cap, alibi_slopes):
        if shortest == longest and not windowed:  # equal lengths: no mask, SDPA's fastest path
            keys, values, keep = keys[:, :longest], values[:, :longest], None
        else:
            keep = _decode_keep(max_len, kv_lens, input_pos, sliding_window)[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q[:, :, None], keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=keep, scale=scale, enable_gqa=groups > 1,
        )
        return out[:, :, 0]
    keep = _decode_keep(max_len, kv_lens, input_pos, sliding_window)
    return _attend_gathered(q, keys, values, keep, scale, sinks, logit_cap, alibi_slopes, input_pos)


def _attend_one(q, k, v, k_cache, v_cache, start_pos, pages, scale, sinks, sliding_window, logit_cap,
                alibi_slopes=None):
    """One sequence: ``q`` [L, n_heads, d] at positions start_pos..start_pos+L-1 (its new keys and values
    ``k``/``v`` [L, n_kv, d]), over its cached pages; a fresh sequence (``start_pos`` 0) has no cached
    prefix and attends over ``k``/``v`` as they are, without gathering them back from the cache."""
    num_new, n_heads, head_dim = q.shape
    _, page_size, n_kv, _ = k_cache.shape
    groups = n_heads // n_kv
    kv_len = start_pos + num_new
    if start_pos == 0:
        keys, values = k, v
    else:
        num_pages = -(-kv_len // page_size)
        used = pages[:num_pages].clamp_min(0)
        keys = _gather_pages(k_cache, used).reshape(num_pages * page_size, n_kv, head_dim)[:kv_len]
        values = _gather_pages(v_cache, used).reshape(num_pages * page_size, n_kv, -1)[:kv_len]
    windowed = sliding_window is not None and sliding_window > 0
    plain_causal = start_pos == 0 and not windowed  # square causal mask: SDPA's own
    sdpa = _use_sdpa(sinks, logit_cap, alibi_slopes)
    keep = None
    if not (plain_causal and sdpa):
        rows = torch.arange(num_new, device=q.device)[:, None] + start_pos
        cols = torch.arange(kv_len, device=q.device)[None, :]
        keep = cols <= rows
        if windowed:
            keep &= (rows - cols) < sliding_window
    if plain_causal and sdpa and native.prefill_attention_available() and native.prefill_attention_takes(q, k, v):
        return torch.ops.auto_deploy.prefill_attention(q, k, v, scale)
    if sdpa:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None].to(q.dtype), values.transpose(0, 1)[None].to(q.dtype),
            attn_mask=keep, is_causal=plain_causal, scale=scale, enable_gqa=groups > 1,
        )
        return out[0].transpose(0, 1)
    # [L, n_kv, g, d] -> [n_kv, g*L, d]: the g query heads of a kv head share one matmul
    qg = q.view(num_new, n_kv, groups, head_dim).permute(1, 2, 0, 3).reshape(n_kv, groups * num_new, head_dim)
    scores = torch.bmm(qg, keys.permute(1, 2, 0).to(q.dtype)).float() * scale
    scores = _scores_epilogue(scores, logit_cap).view(n_kv, groups, num_new, kv_len)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, cols - rows).view(n_kv, groups, num_new, kv_len)
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = _softmax(scores, sinks, (n_kv, groups, 1, 1))
    out = torch.bmm(probs.reshape(n_kv, groups * num_new, kv_len).to(values.dtype), values.permute(1, 0, 2))
    return out.view(n_kv, groups, num_new, -1).permute(2, 0, 1, 3).reshape(num_new, n_heads, -1)


_LIB = torch.library.Library("auto_deploy", "FRAGMENT")
_LIB.define("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos, Tensor page_table, "
            "float scale, int sliding_window) -> Tensor")


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor,
                               page_table: torch.Tensor, scale: float, sliding_window: int) -> torch.Tensor:
    """``auto_deploy::decode_attention``: attention of one new token per sequence (``q`` [..., n_heads, d], the
    leading dims one token per sequence) over its paged cache, which already holds the token's k/v;
    ``sliding_window`` 0 means none; no sinks or soft-capping. This is the plain-torch implementation; the
    native kernel (``native/decode_attention.c``), where it runs, reads the cache in place and matches it to
    float32 rounding."""
    qf = q.reshape(-1, q.shape[-2], q.shape[-1])
    out = _attend_decode(qf, k_cache, v_cache, input_pos.long(), page_table.long(), scale, None,
                         sliding_window if sliding_window > 0 else None, None)
    return out.to(q.dtype).reshape(*q.shape[:-1], v_cache.shape[-1])


_LIB.impl("decode_attention", decode_attention_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::decode_attention", lib=_LIB)
def _decode_attention_fake(q, k_cache, v_cache, input_pos, page_table, scale, sliding_window):
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1])


_LIB.define("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor")


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``auto_deploy::prefill_attention``: causal attention of a fresh sequence over its own keys (``q`` [T,
    n_heads, d], ``k`` / ``v`` [T, n_kv, d], position t attending to keys 0..t), [T, n_heads, v_dim]. This is the
    plain-torch implementation (SDPA); the native kernel, where it runs, matches it to float32 rounding."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype),
                                         v.transpose(0, 1)[None].to(q.dtype), is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).contiguous()


_LIB.impl("prefill_attention", prefill_attention_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::prefill_attention", lib=_LIB)
def _prefill_attention_fake(q, k, v, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


_LIB.define("decode_attention_rope(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
            "Tensor(b!) v_cache, Tensor input_pos, Tensor page_table, float scale, int sliding_window) -> Tensor")


def _rotate_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate_half pairs) of token rows ``x`` [T, heads, d] by ``cos`` / ``sin`` [T, rot]."""
    return rope_reference(x[None], x[None], cos[None], sin[None], unsqueeze_dim=2)[0][0]


def decode_attention_rope_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    input_pos: torch.Tensor, page_table: torch.Tensor, scale: float,
                                    sliding_window: int) -> torch.Tensor:
    """``auto_deploy::decode_attention_rope``: a decode step's attention block in one op. RoPE (rotate_half pairs)
    of the new tokens' ``q`` [T, n_heads, d] and ``k`` [T, n_kv, d] by ``cos`` / ``sin`` [T, rot], ``k`` and ``v``
    written to the caches at ``input_pos`` (one token per sequence), then :func:`decode_attention_reference`. The
    plain-torch implementation; the native one (``native/ops.cpp``) rotates k straight into its cache slot."""
    k_rot = _rotate_rows(k, cos, sin)
    ones = torch.ones_like(input_pos)
    write_kv_cache_reference(k_rot, v, k_cache, v_cache, ones, input_pos, page_table)
    return decode_attention_reference(_rotate_rows(q, cos, sin), k_cache, v_cache, input_pos, page_table, scale,
                                      sliding_window)


_LIB.impl("decode_attention_rope", decode_attention_rope_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::decode_attention_rope", lib=_LIB)
def _decode_attention_rope_fake(q, k, v, cos, sin, k_cache, v_cache, input_pos, page_table, scale, sliding_window):
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1])


def _decode_attention(q, k_cache, v_cache, input_pos, page_table, scale, sliding_window) -> torch.Tensor:
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    return torch.ops.auto_deploy.decode_attention(q, k_cache, v_cache, input_pos, page_table, scale, window)


def cached_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    page_table: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    n_heads, head_dim = q.shape[-2], q.shape[-1]
    n_kv = k.shape[-2]
    if n_heads % n_kv:
        raise ValueError(f"torch_cached_attention: {n_heads} query heads are not a multiple of {n_kv} kv heads")
    qf, kf, vf = _token_rows(q, k, v)
    _write_cache(kf, vf, k_cache, v_cache, seq_lens, input_pos, page_table)
    lens = seq_lens.tolist()
    num_tokens = qf.shape[0]
    decode_only = num_tokens == len(lens) and all(n == 1 for n in lens)  # one token per sequence
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    if decode_only and native.decode_attention_available() and _native_decode_takes(qf, k_cache, v_cache, sinks,
                                                                                    logit_cap, alibi_slopes):
        out = _decode_attention(qf, k_cache, v_cache, input_pos.long(), page_table.long(), scale, sliding_window)
    elif decode_only:
        out = _attend_decode(qf, k_cache, v_cache, input_pos.long(), page_table.long(), scale, sinks, sliding_window,
                             logit_cap, alibi_slopes)
    elif len(lens) == 1 and num_tokens:  # one sequence (a batch-1 prompt): its attention is the output, uncopied
        out = _attend_one(qf, kf, vf, k_cache, v_cache, int(input_pos[0]), page_table[0], scale, sinks, sliding_window,
                          logit_cap, alibi_slopes)
    else:
        out = qf.new_empty(num_tokens, n_heads, v.shape[-1])
        starts = itertools.accumulate(lens, initial=0)
        for s, (start, length, pos) in enumerate(zip(starts, lens, input_pos.tolist())):
            if length:
                tokens = slice(start, start + length)
                out[tokens] = _attend_one(qf[tokens], kf[tokens], vf[tokens], k_cache, v_cache, pos, page_table[s],
                                          scale, sinks, sliding_window, logit_cap, alibi_slopes)
    return out.to(q.dtype).reshape(*q.shape[:-1], v.shape[-1])


# (an implementation importable by its own name: served graphs call it directly, compile/eager.py)
torch_cached_attention = torch.library.custom_op("auto_deploy::torch_cached_attention", cached_attention_reference,
                                                 mutates_args=("k_cache", "v_cache"))


@torch_cached_attention.register_fake
def _torch_cached_attention_fake(q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table, scale=None,
                                 sinks=None, sliding_window=None, logit_cap=None, alibi_slopes=None):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    page_table: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    *,
    native_kernel: bool = False,
) -> torch.Tensor:
    """``torch_cached_attention`` for decode-only batches (one new token per sequence), written for
    ``torch.compile``: no host syncs and no shapes that depend on tensor values. It attends over every
    column of ``page_table`` and masks the slots past each sequence's length, so the caller passes a
    table as wide as the longest sequence needs (wider only costs time). Same arguments and result as
    the op; the caches are written in place.

    With ``native_kernel`` (the caller checked :func:`native.decode_attention_available`), the attention
    after the cache write is ``auto_deploy::decode_attention`` (its native kernel), which reads the cache
    in place and only up to each sequence's length, wherever it takes the inputs (no sinks, soft-capping or
    ALiBi, float32; decided by dtypes and arguments only, so it traces)."""
    head_dim, n_kv = q.shape[-1], k.shape[-2]
    qf, kf, vf = _token_rows(q, k, v)
    input_pos, page_table = input_pos.long(), page_table.long()
    # plain torch: traced into the decode graph, where Inductor fuses it with RoPE
    write_kv_cache_reference(kf, vf, k_cache, v_cache, seq_lens, input_pos, page_table)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if native_kernel and _native_decode_takes(qf, k_cache, v_cache, sinks, logit_cap, alibi_slopes):
        out = _decode_attention(qf, k_cache, v_cache, input_pos, page_table, scale, sliding_window)
        return out.reshape(*q.shape[:-1], v.shape[-1])
    num_seqs, num_pages = page_table.shape
    max_len = num_pages * k_cache.shape[1]
    page_table = page_table.clamp_min(0)  # padding entries (e.g. -1) are gathered, then masked
    keys = _gather_pages(k_cache, page_table).view(num_seqs, max_len, n_kv, head_dim)
    values = _gather_pages(v_cache, page_table).view(num_seqs, max_len, n_kv, v_cache.shape[-1])
    keep = _decode_keep(max_len, input_pos + 1, input_pos, sliding_window)
    out = _attend_gathered(qf, keys, values, keep, scale, sinks, logit_cap, alibi_slopes, input_pos)
    return out.to(q.dtype).reshape(*q.shape[:-1], v.shape[-1])


def _token_rows_layout(t: torch.Tensor) -> bool:
    """Whether [T, heads, d] ``t`` has each token's heads side by side, a dim of one element at any stride (as the
    native kernel reads it, and as torch calls such tensors contiguous)."""
    return (t.shape[-1] == 1 or t.stride(-1) == 1) and (t.shape[-2] == 1 or t.stride(-2) == t.shape[-1])


def paged_decode_attention_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    page_table: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    *,
    native_kernel: bool = False,
) -> torch.Tensor:
    """:func:`paged_decode_attention` of q and k before their RoPE (``rope_reference(q, k, cos, sin,
    unsqueeze_dim=2)``: rotate_half pairs, [batch, seq, heads, head_dim], cos / sin [batch or 1, seq, rot]).

    With ``native_kernel``, where the kernel takes the inputs, the rotation, the cache write and the attention are
    one call, ``auto_deploy::decode_attention_rope``: the compiled decode step then has no kernel of its own
    between the q/k/v product and the attention (docs/performance.md). Otherwise RoPE, then
    :func:`paged_decode_attention`."""
    qf, kf, vf = _token_rows(q, k, v)
    fused = (native_kernel and cos.dtype == torch.float32 and sin.dtype == torch.float32
             and _native_decode_takes(qf, k_cache, v_cache, sinks, logit_cap, alibi_slopes))
    if not fused:
        q, k = rope_reference(q, k, cos, sin, unsqueeze_dim=2)
        return paged_decode_attention(q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table, scale, sinks,
                                      sliding_window, logit_cap, alibi_slopes, native_kernel=native_kernel)
    # the kernel's layouts: each token's heads side by side (the columns of a fused q/k/v product are), cos / sin
    # rows of one token each; decided from strides at trace time, so nothing is copied where they already are
    qf, kf, vf = (t if _token_rows_layout(t) else t.contiguous() for t in (qf, kf, vf))
    rot = cos.shape[-1]
    cos = cos.expand(*q.shape[:2], rot).reshape(-1, rot).contiguous()
    sin = sin.expand(*q.shape[:2], rot).reshape(-1, rot).contiguous()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    out = torch.ops.auto_deploy.decode_attention_rope(qf, kf, vf, cos, sin, k_cache, v_cache, input_pos.contiguous(),
                                                      page_table.contiguous(), scale, window)
    return out.reshape(*q.shape[:-1], v.shape[-1])


def paged_decode_attention_native(*args, **kwargs) -> torch.Tensor:
    """:func:`paged_decode_attention` with ``native_kernel=True`` (a plain function, for graph nodes)."""
    return paged_decode_attention(*args, **kwargs, native_kernel=True)


def paged_decode_attention_rope_native(*args, **kwargs) -> torch.Tensor:
    """:func:`paged_decode_attention_rope` with ``native_kernel=True`` (a plain function, for graph nodes)."""
    return paged_decode_attention_rope(*args, **kwargs, native_kernel=True)


def _native_decode_takes(q, k_cache, v_cache, sinks, logit_cap, alibi_slopes=None) -> bool:
    """The native kernel has no sinks, soft-capping or ALiBi: those take the torch path."""
    return _use_sdpa(sinks, logit_cap, alibi_slopes) and native.decode_attention_takes(q, k_cache, v_cache)


# -- backends -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionBackend:
    """A cached-attention implementation the ``insert_cached_attention`` transform can select.

    ``op`` is called as ``op(q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table, scale=...,
    sinks=..., sliding_window=..., logit_cap=..., alibi_slopes=...)`` with the conventions of the module docstring
    (every backend shares the cache layout [num_pages, page_size, n_kv_heads, head_dim]).
    """

    name: str
    op: Callable
    description: str = ""
    supports_sinks: bool = True
    supports_sliding_window: bool = True
    supports_logit_cap: bool = True
    supports_alibi_slopes: bool = True


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {}
DEFAULT_ATTENTION_BACKEND = "torch"


def register_attention_backend(backend: AttentionBackend) -> AttentionBackend:
    existing = ATTENTION_BACKENDS.get(backend.name)
    if existing is not None and existing != backend:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    ATTENTION_BACKENDS[backend.name] = backend
    return backend


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise ConfigError(f"unknown attention backend {name!r}; registered backends: {known}")
    return ATTENTION_BACKENDS[name]


register_attention_backend(
    AttentionBackend(
        name="torch",
        op=torch.ops.auto_deploy.torch_cached_attention.default,
        description="plain-torch paged attention (CPU-friendly reference backend)",
    )
)

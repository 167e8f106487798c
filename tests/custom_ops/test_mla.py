"""auto_deploy::torch_mla against attention over the expanded keys/values, and torch_cached_mla (the compact
latent cache) against torch_mla over the full sequences."""

import math

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401

ops = torch.ops.auto_deploy
N, NOPE, ROPE, V, LORA, PAGE = 4, 16, 8, 12, 32, 4


def _inputs(batch, seq, dtype=torch.float32, seed=0):
    """q_nope, q_pe [b, s, n, *], kv_latent [b, s, lora], k_pe [b, s, rope], kv_b_weight [n * (nope + v), lora]."""
    g = torch.Generator().manual_seed(seed)
    q_nope, q_pe = torch.randn(batch, seq, N, NOPE, generator=g), torch.randn(batch, seq, N, ROPE, generator=g)
    latent, k_pe = torch.randn(batch, seq, LORA, generator=g), torch.randn(batch, seq, ROPE, generator=g)
    weight = torch.randn(N * (NOPE + V), LORA, generator=g) / math.sqrt(LORA)
    return tuple(t.to(dtype) for t in (q_nope, q_pe, latent, k_pe, weight))


def _expanded_attention(q_nope, q_pe, latent, k_pe, weight, scale=None):
    """What HF's MLA layers compute: keys/values expanded per head from the latent, then causal eager attention."""
    b, s = latent.shape[:2]
    kv = (latent @ weight.T).view(b, s, N, NOPE + V).transpose(1, 2)
    k_nope, v = kv.split([NOPE, V], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, N, -1, -1)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)).float() * (scale or (NOPE + ROPE) ** -0.5)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1).to(v.dtype) @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_mla_matches_expanded_attention(dtype, scale):
    args = _inputs(2, 7, dtype)
    out = ops.torch_mla(*args, scale=scale)
    assert out.shape == (2, 7, N, V) and out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, _expanded_attention(*args, scale=scale), **tol)


def test_fake_shapes_and_a_clear_error_for_a_weight_of_other_heads():
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes = [t.shape for t in _inputs(2, 3)]
    with FakeTensorMode():
        fakes = [torch.empty(s) for s in shapes]
        assert ops.torch_mla(*fakes).shape == (2, 3, N, V)
    q_nope, q_pe, latent, k_pe, weight = _inputs(1, 3)
    with pytest.raises(ValueError, match="does not hold 4 heads of 16 key features"):
        ops.torch_mla(q_nope, q_pe, latent, k_pe, weight[:-1])


def _caches(num_pages, dtype=torch.float32):
    return torch.zeros(num_pages, PAGE, 1, LORA, dtype=dtype), torch.zeros(num_pages, PAGE, 1, ROPE, dtype=dtype)


def _step(chunks, weight, caches, pages):
    """One forward over ``chunks``: (q_nope, q_pe, latent, k_pe, start_pos, seq_id), each [1, L, ...]."""
    parts = [torch.cat([c[j] for c in chunks], 1) for j in range(4)]
    seq_lens = torch.tensor([c[0].shape[1] for c in chunks], dtype=torch.int32)
    input_pos = torch.tensor([c[4] for c in chunks], dtype=torch.int32)
    table = torch.full((len(chunks), max(len(pages[c[5]]) for c in chunks) + 1), -1, dtype=torch.int32)
    for i, c in enumerate(chunks):
        table[i, : len(pages[c[5]])] = torch.tensor(pages[c[5]])
    return ops.torch_cached_mla(*parts, weight, *caches, seq_lens, input_pos, table)


def _part(seq, start, end):
    return tuple(t[:, start:end] for t in seq[:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_mla_prefill_then_decode_matches_uncached(dtype):
    """Prefill expands the prompt's latents; decode attends over the cached ones with kv_b_proj absorbed: the same
    attention, summed in another order (float32: to rounding; bfloat16: to bf16's)."""
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)
    lengths, decode = [7, 3, 10], 4
    full = [_inputs(1, n + decode, dtype, seed=i) for i, n in enumerate(lengths)]
    weight = full[0][4]
    pages = {0: [5, 0, 9], 1: [3, 7, 8], 2: [1, 2, 4, 6]}  # scattered, non-contiguous pages
    caches = _caches(10, dtype)
    out = _step([(*_part(s, 0, n), 0, i) for i, (s, n) in enumerate(zip(full, lengths))], weight, caches, pages)
    ref = torch.cat([ops.torch_mla(*_part(s, 0, n), weight) for s, n in zip(full, lengths)], 1)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol)
    for step in range(decode):
        at = [n + step for n in lengths]
        out = _step([(*_part(s, p, p + 1), p, i) for i, (s, p) in enumerate(zip(full, at))], weight, caches, pages)
        ref = torch.cat([ops.torch_mla(*_part(s, 0, p + 1), weight)[:, -1:] for s, p in zip(full, at)], 1)
        torch.testing.assert_close(out, ref, **tol)
    # the caches hold each token's latent and rope key where the page table puts it
    latent_cache, pe_cache = caches
    s, p = full[2], 9  # sequence 2's token 9: its third page (4), slot 1
    torch.testing.assert_close(latent_cache[4, 1, 0], s[2][0, p], rtol=0, atol=0)
    torch.testing.assert_close(pe_cache[4, 1, 0], s[3][0, p], rtol=0, atol=0)


def test_cached_mla_mixed_decode_and_chunked_prefill():
    a, b, c = (_inputs(1, n, seed=s) for n, s in ((9, 1), (6, 2), (5, 3)))
    weight = a[4]
    pages = {0: [0, 1, 2], 1: [3, 4], 2: [5, 6]}
    caches = _caches(7)
    _step([(*_part(a, 0, 8), 0, 0), (*_part(b, 0, 3), 0, 1)], weight, caches, pages)
    # one forward: a decodes its 9th token, b prefills a chunk of 3 after its first 3, c prefills
    out = _step([(*_part(a, 8, 9), 8, 0), (*_part(b, 3, 6), 3, 1), (*_part(c, 0, 5), 0, 2)], weight, caches, pages)
    ref = torch.cat([ops.torch_mla(*_part(a, 0, 9), weight)[:, 8:], ops.torch_mla(*_part(b, 0, 6), weight)[:, 3:],
                     ops.torch_mla(*_part(c, 0, 5), weight)], 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

"""The native decode attention (``auto_deploy::decode_attention``): the same output as the graph form
``paged_decode_attention`` (itself checked against uncached attention in test_cached_attention.py) for
every head layout, page size, sliding window and length, read from the cache in place; its callers
(the compile form and the eager op) fall back where it does not apply; bad page tables are errors. The same for
``auto_deploy::decode_attention_rope`` (RoPE and the cache write in the same call) against RoPE followed by
``paged_decode_attention``."""

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops import native
from autodeploy.custom_ops.cached_attention import (
    decode_attention_rope_reference,
    paged_decode_attention,
    paged_decode_attention_native,
    paged_decode_attention_rope_native,
    write_kv_cache_reference,
)
from autodeploy.custom_ops.rope import rope_reference

pytestmark = pytest.mark.skipif(not native.decode_attention_available(), reason="the native kernels do not run here")

cached_attention = torch.ops.auto_deploy.torch_cached_attention


def _batch(positions, n_heads, n_kv, head_dim, page_size, seed=0, v_dim=None):
    """Caches filled with random history, pages shuffled across sequences, a table one column wider than
    needed (padded with -1), and one new token per sequence."""
    gen = torch.Generator().manual_seed(seed)
    v_dim = v_dim or head_dim
    widths = [p // page_size + 1 for p in positions]
    width = max(widths) + 1
    num_pages = sum(widths) + 2
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(positions), width), -1, dtype=torch.int32)
    used = 0
    for s, w in enumerate(widths):
        table[s, :w] = order[used : used + w]
        used += w
    kc = torch.randn(num_pages, page_size, n_kv, head_dim, generator=gen)
    vc = torch.randn(num_pages, page_size, n_kv, v_dim, generator=gen)
    num = len(positions)
    q = torch.randn(1, num, n_heads, head_dim, generator=gen) * 2
    k = torch.randn(1, num, n_kv, head_dim, generator=gen)
    v = torch.randn(1, num, n_kv, v_dim, generator=gen)
    rest = (torch.ones(num, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32), table)
    return q, k, v, kc, vc, rest


@pytest.mark.parametrize(
    "positions, n_heads, n_kv, head_dim, page_size",
    [
        ([150], 12, 4, 64, 64),  # the benchmark's layout: grouped query heads, three pages
        ([0, 15, 16, 47], 4, 4, 64, 16),  # first token, page boundaries, lengths around a vector of 16
        ([5, 33, 70], 8, 1, 128, 32),  # one kv head for all query heads; head size 128
        ([9, 20], 6, 2, 48, 8),  # a head size without its own specialization
        # the kernel's work items are whole sequences where there are 4 a thread: 16 sequences (grouped and one
        # kv head per query head), 5 (whole on one thread, single kv heads on two)
        (list(range(60, 220, 10)), 12, 4, 64, 64),
        (list(range(3, 200, 13)), 6, 6, 32, 16),
        ([3, 17, 40, 64, 65], 6, 3, 64, 16),
    ],
)
@pytest.mark.parametrize("window", [None, 7])
def test_matches_the_graph_form(positions, n_heads, n_kv, head_dim, page_size, window, kernels):
    q, k, v, kc, vc, rest = _batch(positions, n_heads, n_kv, head_dim, page_size)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    expected = paged_decode_attention(q, k, v, kc_ref, vc_ref, *rest, sliding_window=window)
    out = paged_decode_attention_native(q, k, v, kc, vc, *rest, sliding_window=window)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close((kc, vc), (kc_ref, vc_ref), atol=0, rtol=0)  # the same cache writes
    # the tolerance rejects attending one position too few (the newest token's own key)
    seq_lens, input_pos, table = rest
    cut = torch.ops.auto_deploy.decode_attention(q.reshape(-1, n_heads, head_dim), kc, vc,
                                                 (input_pos - 1).clamp_min(0).long(), table.long(), head_dim ** -0.5,
                                                 window or 0)
    assert not torch.allclose(cut.reshape(out.shape), expected, atol=2e-6, rtol=2e-5)


def test_value_head_size_may_differ(kernels):
    q, k, v, kc, vc, rest = _batch([3, 40], 4, 2, 32, 16, v_dim=64)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    expected = paged_decode_attention(q, k, v, kc_ref, vc_ref, *rest)
    torch.testing.assert_close(paged_decode_attention_native(q, k, v, kc, vc, *rest), expected, atol=2e-6, rtol=2e-5)


@pytest.mark.slow  # compiles with Inductor
def test_compiles_without_graph_breaks():
    q, k, v, kc, vc, rest = _batch([20, 70], 12, 4, 64, 32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    expected = paged_decode_attention(q, k, v, kc_ref, vc_ref, *rest)
    compiled = torch.compile(paged_decode_attention_native, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(q, k, v, kc, vc, *rest), expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close((kc, vc), (kc_ref, vc_ref), atol=0, rtol=0)  # the write reached the caches


@pytest.mark.parametrize("kw", [{"logit_cap": 2.0}, {"sinks": "random"}, {"dtype": torch.bfloat16}])
def test_falls_back_where_it_does_not_apply(kw):
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.float32)
    if kw.get("sinks") == "random":
        kw["sinks"] = torch.randn(12)
    q, k, v, kc, vc, rest = _batch([30], 12, 4, 64, 16)
    q, k, v, kc, vc = (t.to(dtype) for t in (q, k, v, kc, vc))
    assert not native.decode_attention_takes(q, kc, vc) or kw
    kc_ref, vc_ref = kc.clone(), vc.clone()
    expected = paged_decode_attention(q, k, v, kc_ref, vc_ref, *rest, **kw)
    torch.testing.assert_close(paged_decode_attention_native(q, k, v, kc, vc, *rest, **kw), expected, atol=0, rtol=0)


def test_takes_only_supported_inputs():
    q, _, _, kc, vc, _ = _batch([3], 4, 2, 64, 16)
    assert native.decode_attention_takes(q, kc, vc)
    assert not native.decode_attention_takes(q.bfloat16(), kc, vc)
    assert not native.decode_attention_takes(q, kc.transpose(0, 1), vc)  # contiguous caches only
    q34, _, _, kc34, vc34, _ = _batch([3], 4, 2, 34, 16)
    assert not native.decode_attention_takes(q34, kc34, vc34)  # head sizes in whole vectors


def test_eager_op_decodes_with_it(monkeypatch):
    """The eager cached-attention op takes the native kernel for decode-only batches, with the result of
    its own torch path."""
    q, k, v, kc, vc, rest = _batch([12, 64, 99], 12, 4, 64, 32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out = cached_attention(q, k, v, kc, vc, *rest)
    monkeypatch.setattr(native, "decode_attention_available", lambda: False)
    expected = cached_attention(q, k, v, kc_ref, vc_ref, *rest)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close((kc, vc), (kc_ref, vc_ref), atol=0, rtol=0)


def test_operator_checks_its_inputs():
    q, k, v, kc, vc, (seq_lens, input_pos, table) = _batch([20], 4, 2, 64, 16)
    rows = q.reshape(-1, 4, 64)
    pos, pages = input_pos.long(), table.long()
    write_kv_cache_reference(k.reshape(-1, 2, 64), v.reshape(-1, 2, 64), kc, vc, seq_lens, pos, pages)
    op = torch.ops.auto_deploy.decode_attention
    bad = pages.clone()
    bad[0, 1] = kc.shape[0]  # a page the cache does not have
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(rows, kc, vc, pos, bad, 0.125, 0)
    with pytest.raises(RuntimeError, match="past the page table"):
        op(rows, kc, vc, pos, pages[:, :1], 0.125, 0)  # position 20 needs a second page
    with pytest.raises(RuntimeError, match="float32"):
        op(rows.bfloat16(), kc, vc, pos, pages, 0.125, 0)
    with pytest.raises(RuntimeError, match="multiples of"):
        op(rows[..., :34].contiguous(), kc[..., :34].contiguous(), vc[..., :34].contiguous(), pos, pages, 0.125, 0)
    torch.library.opcheck(torch.ops.auto_deploy.decode_attention.default, (rows, kc, vc, pos, pages, 0.125, 0))


def _prompts(lens, starts, n_kv=2, head_dim=64, v_dim=32, page_size=8, seed=0):
    """Sequences of `lens` new tokens from cache positions `starts`, their pages shuffled, the table padded
    with -1; caches holding random history."""
    gen = torch.Generator().manual_seed(seed)
    widths = [(s + n - 1) // page_size + 1 for n, s in zip(lens, starts)]
    num_pages = sum(widths) + 3
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), max(widths) + 1), -1, dtype=torch.int32)
    used = 0
    for s, w in enumerate(widths):
        table[s, :w] = order[used : used + w]
        used += w
    caches = (torch.randn(num_pages, page_size, n_kv, head_dim, generator=gen),
              torch.randn(num_pages, page_size, n_kv, v_dim, generator=gen))
    kv = (torch.randn(sum(lens), n_kv, head_dim, generator=gen), torch.randn(sum(lens), n_kv, v_dim, generator=gen))
    return kv, caches, (torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), table)


@pytest.mark.parametrize("lens, starts", [([13], [0]), ([5, 1, 9], [0, 17, 6]), ([1, 1, 1], [3, 8, 0]),
                                          ([2, 0, 3], [7, 4, 0])])
def test_write_kv_cache_copies_the_rows_the_reference_scatters(lens, starts):
    (k, v), caches, rest = _prompts(lens, starts)
    expected = tuple(c.clone() for c in caches)
    torch.ops.auto_deploy.write_kv_cache(k, v, *caches, *rest)
    write_kv_cache_reference(k, v, *expected, *rest)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_write_kv_cache_checks_pages_and_positions():
    (k, v), caches, (seq_lens, starts, table) = _prompts([5], [6])
    bad = table.clone()
    bad[0, 1] = caches[0].shape[0]  # a page the cache does not have
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.auto_deploy.write_kv_cache(k, v, *caches, seq_lens, starts, bad)
    with pytest.raises(RuntimeError, match="outside its page table"):
        torch.ops.auto_deploy.write_kv_cache(k, v, *caches, seq_lens, starts, table[:, :1])  # position 8: page 2
    with pytest.raises(RuntimeError, match="seq_lens sum to"):
        torch.ops.auto_deploy.write_kv_cache(k[:4], v[:4], *caches, seq_lens, starts, table)


def test_prompts_write_the_cache_natively_or_not_alike(monkeypatch):
    (k, v), caches, rest = _prompts([6, 11], [0, 5], v_dim=64)
    q = torch.randn(1, 17, 4, 64, generator=torch.Generator().manual_seed(1))
    native_caches = tuple(c.clone() for c in caches)
    out = cached_attention(q, k[None], v[None], *native_caches, *rest)
    monkeypatch.setattr(native, "write_kv_cache_available", lambda: False)
    expected = cached_attention(q, k[None], v[None], *caches, *rest)
    assert torch.equal(out, expected)
    assert torch.equal(native_caches[0], caches[0]) and torch.equal(native_caches[1], caches[1])


def test_write_kv_cache_reads_the_columns_of_a_fused_product():
    """k and v as views of a fused q/k/v product's rows (tokens strided, heads side by side), int64 indices."""
    (k, v), caches, (seq_lens, starts, table) = _prompts([4, 9], [2, 0], v_dim=64)
    fused = torch.cat([torch.randn(13, 4 * 64), k.reshape(13, -1), v.reshape(13, -1)], dim=1)
    k_view, v_view = fused[:, 256:384].view(13, 2, 64), fused[:, 384:].view(13, 2, 64)
    assert not k_view.is_contiguous()
    expected = tuple(c.clone() for c in caches)
    torch.ops.auto_deploy.write_kv_cache(k_view, v_view, *caches, seq_lens.long(), starts.long(), table.long())
    write_kv_cache_reference(k, v, *expected, seq_lens, starts, table)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


# -- RoPE, the cache write and the attention in one call (decode_attention_rope) --------------------------------
def _rope_tables(num, rot, seed=1):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(1, num, rot // 2, generator=gen) * 6
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


@pytest.mark.parametrize(
    "positions, n_heads, n_kv, head_dim, rot, page_size",
    [
        ([150], 12, 4, 64, 64, 64),  # the benchmark's layout
        ([0, 15, 16, 47], 4, 4, 64, 64, 16),  # first token, page boundaries
        ([5, 33, 70], 8, 1, 128, 64, 32),  # partial rotary (half the head), one kv head
        (list(range(3, 200, 13)), 6, 3, 32, 32, 16),  # 16 sequences
    ],
)
@pytest.mark.parametrize("window", [None, 7])
def test_rope_fused_matches_rope_then_attention(positions, n_heads, n_kv, head_dim, rot, page_size, window, kernels):
    """q, k and v as the columns of one fused q/k/v product (strided views), as the decode step hands them over;
    the same output and the same cache contents as RoPE followed by paged_decode_attention."""
    q, k, v, kc, vc, rest = _batch(positions, n_heads, n_kv, head_dim, page_size)
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)
    q, k, v = (t.view(*t.shape[:2], -1, head_dim)
               for t in qkv.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], -1))
    cos, sin = _rope_tables(len(positions), rot)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_rot, k_rot = rope_reference(q, k, cos, sin, unsqueeze_dim=2)
    expected = paged_decode_attention(q_rot, k_rot, v, kc_ref, vc_ref, *rest, sliding_window=window)
    out = paged_decode_attention_rope_native(q, k, v, cos, sin, kc, vc, *rest, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close((kc, vc), (kc_ref, vc_ref), atol=1e-6, rtol=1e-6)  # k rotated into its slot
    # the eager op (its plain-torch implementation) agrees too, from the same caches as before
    kc_eager, vc_eager = kc_ref.clone(), vc_ref.clone()
    eager = decode_attention_rope_reference(q.reshape(-1, n_heads, head_dim), k.reshape(-1, n_kv, head_dim),
                                            v.reshape(-1, n_kv, head_dim), cos[0], sin[0], kc_eager, vc_eager,
                                            rest[1], rest[2], head_dim ** -0.5, window or 0)
    torch.testing.assert_close(eager.reshape(out.shape), expected, atol=2e-6, rtol=2e-5)


def test_rope_fused_falls_back_where_it_does_not_apply():
    """Soft-capping has no native path: RoPE, then the plain form, with its result to the bit."""
    q, k, v, kc, vc, rest = _batch([30, 41], 12, 4, 64, 16)
    cos, sin = _rope_tables(2, 64)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_rot, k_rot = rope_reference(q, k, cos, sin, unsqueeze_dim=2)
    expected = paged_decode_attention(q_rot, k_rot, v, kc_ref, vc_ref, *rest, logit_cap=2.0)
    out = paged_decode_attention_rope_native(q, k, v, cos, sin, kc, vc, *rest, logit_cap=2.0)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close((kc, vc), (kc_ref, vc_ref), atol=0, rtol=0)


def test_rope_fused_operator_checks_its_inputs():
    q, k, v, kc, vc, (_, input_pos, table) = _batch([20], 4, 2, 64, 16)
    q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    cos, sin = (t[0] for t in _rope_tables(1, 64))
    op = torch.ops.auto_deploy.decode_attention_rope
    bad = table.clone()
    bad[0, 1] = kc.shape[0]  # a page the cache does not have
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(q, k, v, cos, sin, kc, vc, input_pos, bad, 0.125, 0)
    with pytest.raises(RuntimeError, match="past the page table"):
        op(q, k, v, cos, sin, kc, vc, input_pos, table[:, :1], 0.125, 0)  # position 20 needs a second page
    with pytest.raises(RuntimeError, match="rot even"):
        op(q, k, v, cos[:, :63], sin[:, :63], kc, vc, input_pos, table, 0.125, 0)


def test_rope_fused_takes_any_layout_of_q_k_v(kernels):
    """q with its heads transposed in memory and v with every other feature: copied into the kernel's layout."""
    q, k, v, kc, vc, rest = _batch([9, 30], 4, 2, 64, 16)
    cos, sin = _rope_tables(2, 64)
    q_odd = q.transpose(1, 2).contiguous().transpose(1, 2)  # [1, seq, heads, d] with heads outermost in memory
    v_odd = torch.stack([v, torch.zeros_like(v)], -1).flatten(-2)[..., ::2]  # last dim at stride 2
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_rot, k_rot = rope_reference(q, k, cos, sin, unsqueeze_dim=2)
    expected = paged_decode_attention(q_rot, k_rot, v, kc_ref, vc_ref, *rest)
    out = paged_decode_attention_rope_native(q_odd, k, v_odd, cos, sin, kc, vc, *rest)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close((kc, vc), (kc_ref, vc_ref), atol=1e-6, rtol=1e-6)


def test_rope_fused_takes_one_kv_head_at_any_stride(kernels):
    """A single kv head's dim may have any stride (torch calls such a tensor contiguous; a sharded rank's k and v
    arrive so from Inductor): the kernel reads it in place."""
    q, k, v, kc, vc, rest = _batch([9, 30], 4, 1, 16, 16)
    cos, sin = _rope_tables(2, 16)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_rot, k_rot = rope_reference(q, k, cos, sin, unsqueeze_dim=2)
    expected = paged_decode_attention(q_rot, k_rot, v, kc_ref, vc_ref, *rest)
    rows = [t.reshape(-1, 1, 16).as_strided((2, 1, 16), (16, 64, 1)) for t in (k, v)]
    out = torch.ops.auto_deploy.decode_attention_rope(q.reshape(-1, 4, 16), *rows, cos[0], sin[0], kc, vc, rest[1],
                                                      rest[2], 16 ** -0.5, 0)
    torch.testing.assert_close(out.reshape(expected.shape), expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close((kc, vc), (kc_ref, vc_ref), atol=1e-6, rtol=1e-6)

"""auto_deploy::torch_cached_attention against the uncached torch_attention over the full sequences."""

import pytest
import torch

import autodeploy.custom_ops.attention  # noqa: F401
from autodeploy.custom_ops.cached_attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    get_attention_backend,
    paged_decode_attention,
    register_attention_backend,
)
from autodeploy.errors import ConfigError

cached_attention = torch.ops.auto_deploy.torch_cached_attention
attention = torch.ops.auto_deploy.torch_attention

N_HEADS, N_KV, HEAD_DIM, PAGE = 4, 2, 8, 4
ALIBI = 2.0 ** -torch.arange(1.0, N_HEADS + 1)  # bloom's slopes for 4 heads


def _seq(length, n_heads=N_HEADS, n_kv=N_KV, d=HEAD_DIM, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, length, n_heads, d, generator=g), torch.randn(1, length, n_kv, d, generator=g),
            torch.randn(1, length, n_kv, d, generator=g))


def _reference(q, k, v, **kw):
    return attention(q, k, v, is_causal=True, layout="bsnd", **kw)


def _caches(num_pages, n_kv=N_KV, d=HEAD_DIM):
    return torch.zeros(num_pages, PAGE, n_kv, d), torch.zeros(num_pages, PAGE, n_kv, d)


def _step(chunks, kc, vc, pages, **kw):
    """One forward over ``chunks``: list of (q, k, v, start_pos, seq_id) with tokens [1, L, n, d]."""
    q = torch.cat([c[0] for c in chunks], 1)
    k = torch.cat([c[1] for c in chunks], 1)
    v = torch.cat([c[2] for c in chunks], 1)
    seq_lens = torch.tensor([c[0].shape[1] for c in chunks], dtype=torch.int32)
    input_pos = torch.tensor([c[3] for c in chunks], dtype=torch.int32)
    width = max(len(pages[c[4]]) for c in chunks) + 1
    table = torch.zeros(len(chunks), width, dtype=torch.int32)
    for i, c in enumerate(chunks):
        table[i, : len(pages[c[4]])] = torch.tensor(pages[c[4]])
    return cached_attention(q, k, v, kc, vc, seq_lens, input_pos, table, **kw)


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3}, {"logit_cap": 2.0}, {"scale": 0.3},
                                {"alibi_slopes": ALIBI}, {"alibi_slopes": ALIBI, "sliding_window": 3}])
def test_prefill_then_decode_matches_uncached(kw):
    lengths = [7, 3, 10]  # prompt lengths; each sequence then decodes 4 more tokens
    decode = 4
    full = [_seq(n + decode, seed=i) for i, n in enumerate(lengths)]
    pages = {0: [5, 0, 9], 1: [3, 7, 8], 2: [1, 2, 4, 6]}  # scattered, non-contiguous pages
    kc, vc = _caches(10)
    prefill = [(q[:, :n], k[:, :n], v[:, :n], 0, i) for i, ((q, k, v), n) in enumerate(zip(full, lengths))]
    out = _step(prefill, kc, vc, pages, **kw)
    ref = torch.cat([_reference(q[:, :n], k[:, :n], v[:, :n], **kw) for (q, k, v), n in zip(full, lengths)], 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for step in range(decode):  # decode-only batches take the vectorized path
        chunks = [(q[:, n + step : n + step + 1], k[:, n + step : n + step + 1], v[:, n + step : n + step + 1],
                   n + step, i)
                  for i, ((q, k, v), n) in enumerate(zip(full, lengths))]
        out = _step(chunks, kc, vc, pages, **kw)
        ref = torch.cat([_reference(q[:, : n + step + 1], k[:, : n + step + 1], v[:, : n + step + 1], **kw)[:, -1:]
                         for (q, k, v), n in zip(full, lengths)], 1)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # compiles with Inductor
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3}, {"logit_cap": 2.0}, {"sinks": "random"},
                                {"alibi_slopes": ALIBI}])
def test_paged_decode_attention_matches_the_op(kw):
    """The torch.compile form for decode batches: same output and same cache writes as the op, for
    sequences of different lengths, a table wider than needed (padded with -1), and under
    torch.compile(fullgraph=True) (no graph break)."""
    if kw.get("sinks") == "random":
        kw = {"sinks": torch.randn(N_HEADS)}
    lengths = [2, 9, 5]
    full = [_seq(n + 1, seed=10 + i) for i, n in enumerate(lengths)]
    table = torch.tensor([[4, -1, -1, -1], [0, 1, 6, -1], [3, 5, -1, -1]], dtype=torch.int32)
    kc, vc = _caches(7)
    for i, ((q, k, v), n) in enumerate(zip(full, lengths)):  # prefill each sequence through the op
        cached_attention(q[:, :n], k[:, :n], v[:, :n], kc, vc, torch.tensor([n], dtype=torch.int32),
                         torch.tensor([0], dtype=torch.int32), table[i : i + 1].clamp_min(0), **kw)
    q, k, v = (torch.cat([t[j][:, n : n + 1] for t, n in zip(full, lengths)], 1) for j in range(3))
    args = (torch.ones(3, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32), table)
    kc2, vc2 = kc.clone(), vc.clone()
    expected = cached_attention(q, k, v, kc, vc, *args, **kw)
    ref = torch.cat([_reference(a[:, : n + 1], b[:, : n + 1], c[:, : n + 1], **kw)[:, -1:]
                     for (a, b, c), n in zip(full, lengths)], 1)
    torch.testing.assert_close(expected, ref, atol=1e-5, rtol=1e-5)
    kc3, vc3 = kc2.clone(), vc2.clone()
    torch.testing.assert_close(paged_decode_attention(q, k, v, kc2, vc2, *args, **kw), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((kc2, vc2), (kc, vc), atol=0, rtol=0)
    compiled = torch.compile(paged_decode_attention, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(q, k, v, kc3, vc3, *args, **kw), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((kc3, vc3), (kc, vc), atol=0, rtol=0)


@pytest.mark.parametrize("kw", [{}, {"alibi_slopes": ALIBI}])
def test_mixed_prefill_decode_and_chunked_prefill(kw):
    a, b, c = _seq(9, seed=1), _seq(6, seed=2), _seq(5, seed=3)
    pages = {0: [0, 1, 2], 1: [3, 4], 2: [5, 6]}
    kc, vc = _caches(7)
    sl = lambda t, s, e: tuple(x[:, s:e] for x in t)  # noqa: E731
    _step([(*sl(a, 0, 8), 0, 0), (*sl(b, 0, 3), 0, 1)], kc, vc, pages, **kw)
    # one forward: a decodes its 9th token, b prefills a chunk of 3 after its first 3, c prefills
    out = _step([(*sl(a, 8, 9), 8, 0), (*sl(b, 3, 6), 3, 1), (*sl(c, 0, 5), 0, 2)], kc, vc, pages, **kw)
    ref = torch.cat([_reference(*a, **kw)[:, 8:], _reference(*b, **kw)[:, 3:], _reference(*c, **kw)], 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sinks_and_mha():
    q, k, v = _seq(6, n_heads=4, n_kv=4, seed=4)
    sinks = torch.randn(4)
    kc, vc = _caches(2, n_kv=4)
    out = _step([(q[:, :5], k[:, :5], v[:, :5], 0, 0)], kc, vc, {0: [1, 0]}, sinks=sinks)
    out2 = _step([(q[:, 5:], k[:, 5:], v[:, 5:], 5, 0)], kc, vc, {0: [1, 0]}, sinks=sinks)
    torch.testing.assert_close(torch.cat([out, out2], 1), _reference(q, k, v, sinks=sinks), atol=1e-5, rtol=1e-5)


def test_writes_cache_slots():
    q, k, v = _seq(5)
    kc, vc = _caches(3)
    _step([(q, k, v, 0, 0)], kc, vc, {0: [2, 0]})
    torch.testing.assert_close(kc[2], k[0, :4])
    torch.testing.assert_close(vc[0, 0], v[0, 4])
    assert kc[1].abs().sum() == 0 and kc[0, 1:].abs().sum() == 0  # nothing else touched


@pytest.mark.parametrize("kw", [{}, {"alibi_slopes": ALIBI}])
def test_bf16_and_fake(kw):
    q, k, v = (t.bfloat16() for t in _seq(6))
    kc, vc = (t.bfloat16() for t in _caches(2))
    out = _step([(q, k, v, 0, 0)], kc, vc, {0: [0, 1]}, **kw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, k, v, **kw).float(), atol=2e-2, rtol=2e-2)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = _step([(q, k, v, 0, 0)], kc, vc, {0: [0, 1]})
    assert fake.shape == q.shape


def test_backend_registry():
    assert get_attention_backend("torch").op is torch.ops.auto_deploy.torch_cached_attention.default
    with pytest.raises(ConfigError, match="registered backends: .*torch"):
        get_attention_backend("nope")
    register_attention_backend(AttentionBackend("test_dummy", op=cached_attention.default))
    try:
        assert get_attention_backend("test_dummy").name == "test_dummy"
        with pytest.raises(ValueError):
            register_attention_backend(AttentionBackend("test_dummy", op=attention.default))
    finally:
        ATTENTION_BACKENDS.pop("test_dummy")


@pytest.mark.parametrize("kw", [{}, {"logit_cap": 2.0}])
def test_value_head_dim_unlike_qk_head_dim(kw):
    """MLA: k heads of 32 features, v heads of 16 (each a multiple of the native kernel's vector width, so a
    float32 decode takes it where it runs), a v cache of its own width; prefill then decode against the uncached op."""
    def seq(length, seed):
        q, k, _ = _seq(length, d=32, seed=seed)
        return q, k, torch.randn(1, length, N_KV, 16, generator=torch.Generator().manual_seed(seed + 100))

    lengths, decode = [6, 3], 3
    full = [seq(n + decode, seed=i) for i, n in enumerate(lengths)]
    pages = {0: [2, 0, 4], 1: [1, 3]}
    kc, vc = torch.zeros(5, PAGE, N_KV, 32), torch.zeros(5, PAGE, N_KV, 16)
    out = _step([(q[:, :n], k[:, :n], v[:, :n], 0, i) for i, ((q, k, v), n) in enumerate(zip(full, lengths))],
                kc, vc, pages, **kw)
    assert out.shape == (1, sum(lengths), N_HEADS, 16)
    ref = torch.cat([_reference(q[:, :n], k[:, :n], v[:, :n], **kw) for (q, k, v), n in zip(full, lengths)], 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for step in range(decode):
        at = [n + step for n in lengths]
        out = _step([(q[:, p : p + 1], k[:, p : p + 1], v[:, p : p + 1], p, i) for i, ((q, k, v), p) in
                     enumerate(zip(full, at))], kc, vc, pages, **kw)
        ref = torch.cat([_reference(q[:, : p + 1], k[:, : p + 1], v[:, : p + 1], **kw)[:, -1:]
                         for (q, k, v), p in zip(full, at)], 1)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

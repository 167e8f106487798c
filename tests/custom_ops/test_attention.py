"""auto_deploy::torch_attention / torch_repeat_kv against straightforward math."""

import math

import pytest
import torch
import torch.nn.functional as F

import autodeploy.custom_ops  # noqa: F401

ops = torch.ops.auto_deploy


def _qkv(b=2, n=4, n_kv=2, s=5, kv=5, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, s, d, generator=gen)
    k = torch.randn(b, n_kv, kv, d, generator=gen)
    v = torch.randn(b, n_kv, kv, d, generator=gen)
    return q, k, v


def _reference(q, k, v, *, scale=None, window=None, cap=None, sinks=None, mask=None):
    """Explicit softmax attention, bnsd, bottom-right causal; kv heads repeated."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    seq, kv = q.shape[2], k.shape[2]
    i = torch.arange(seq)[:, None] + kv - seq
    j = torch.arange(kv)[None]
    keep = j <= i
    if window is not None:
        keep &= i - j < window
    s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s + mask
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, seq, 1)], -1)
        return s.softmax(-1)[..., :kv] @ v
    return s.softmax(-1) @ v


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_gqa_matches_sdpa(n_kv):
    q, k, v = _qkv(n_kv=n_kv)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ops.torch_attention(q, k, v), expected)


def test_bsnd_layout_and_scale():
    q, k, v = _qkv()
    expected = _reference(q, k, v, scale=0.3)
    out = ops.torch_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.3, layout="bsnd")
    assert out.shape == (2, 5, 4, 8)
    torch.testing.assert_close(out.transpose(1, 2), expected)


def test_causal_with_longer_kv_is_bottom_right_aligned():
    q, k, v = _qkv(s=3, kv=7)
    torch.testing.assert_close(ops.torch_attention(q, k, v), _reference(q, k, v))
    # the last query row sees every key: same as non-causal attention for that row
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(ops.torch_attention(q, k, v)[:, :, -1], full[:, :, -1])


def test_sliding_window():
    q, k, v = _qkv(s=9, kv=9)
    out = ops.torch_attention(q, k, v, sliding_window=3)
    torch.testing.assert_close(out, _reference(q, k, v, window=3))
    assert not torch.allclose(out, ops.torch_attention(q, k, v))


def test_logit_softcap():
    q, k, v = _qkv()
    q = q * 10
    out = ops.torch_attention(q, k, v, logit_cap=5.0)
    torch.testing.assert_close(out, _reference(q, k, v, cap=5.0))
    assert not torch.allclose(out, ops.torch_attention(q, k, v))


def test_sinks():
    q, k, v = _qkv()
    sinks = torch.randn(4)
    out = ops.torch_attention(q, k, v, sinks=sinks)
    torch.testing.assert_close(out, _reference(q, k, v, sinks=sinks))
    out_bsnd = ops.torch_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sinks=sinks, layout="bsnd")
    torch.testing.assert_close(out_bsnd.transpose(1, 2), out)


def test_masks_additive_and_bool():
    q, k, v = _qkv()
    mask = torch.randn(2, 1, 5, 5)
    torch.testing.assert_close(ops.torch_attention(q, k, v, attn_mask=mask), _reference(q, k, v, mask=mask))
    keep = torch.ones(5, 5, dtype=torch.bool)
    keep[:, 0] = False
    keep[0, 0] = True  # row 0 keeps its only causal key
    expected = _reference(q, k, v, mask=torch.zeros(5, 5).masked_fill(~keep, float("-inf")))
    torch.testing.assert_close(ops.torch_attention(q, k, v, attn_mask=keep), expected)


def test_bf16_close_to_fp32():
    q, k, v = _qkv()
    out = ops.torch_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ops.torch_attention(q, k, v), atol=3e-2, rtol=3e-2)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(2, 3, 8, 16), torch.empty(2, 3, 2, 16), torch.empty(2, 3, 2, 16)
        assert ops.torch_attention(q, k, v, layout="bsnd").shape == (2, 3, 8, 16)
        assert ops.torch_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).shape == (2, 8, 3, 16)
        assert ops.torch_repeat_kv(k.transpose(1, 2), 4).shape == (2, 8, 3, 16)


def test_repeat_kv_matches_hf():
    from transformers.models.llama.modeling_llama import repeat_kv

    _, k, _ = _qkv()
    torch.testing.assert_close(ops.torch_repeat_kv(k, 3), repeat_kv(k, 3))
    torch.testing.assert_close(ops.torch_repeat_kv(k, 1), k)


@pytest.mark.parametrize("layout", ["bnsd", "bsnd"])
def test_value_head_dim_unlike_qk_head_dim(layout):
    """MLA (DeepSeek, MiniCPM3): q/k heads of nope + rope features, v heads of another size; the output has v's."""
    q, k, _ = _qkv(d=24)
    v = torch.randn(2, 2, 5, 16, generator=torch.Generator().manual_seed(1))
    expected = _reference(q, k, v, scale=0.2)
    t = (lambda x: x.transpose(1, 2)) if layout == "bsnd" else (lambda x: x)
    out = ops.torch_attention(t(q), t(k), t(v), scale=0.2, layout=layout)
    assert out.shape == t(expected).shape == t(torch.empty(2, 4, 5, 16)).shape
    torch.testing.assert_close(t(out), expected)
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes = [tuple(t(x).shape) for x in (q, k, v)]
    with FakeTensorMode():
        assert ops.torch_attention(*(torch.empty(s) for s in shapes), layout=layout).shape == out.shape


@pytest.mark.parametrize("s, kv", [(6, 6), (3, 7)])
def test_alibi_matches_hf_key_position_bias(s, kv):
    """HF adds ``slope[h] * j`` (bloom) to the scores; the op adds ``slope[h] * (j - i)``: the same softmax."""
    q, k, v = _qkv(s=s, kv=kv)
    slopes = 2.0 ** -torch.arange(1.0, 5.0)
    hf_bias = (slopes[:, None, None] * torch.arange(kv)[None, None, :]).expand(4, s, kv)
    out = ops.torch_attention(q, k, v, alibi_slopes=slopes)
    torch.testing.assert_close(out, _reference(q, k, v, mask=hf_bias))
    assert not torch.allclose(out, ops.torch_attention(q, k, v), atol=1e-3)
    out_bsnd = ops.torch_attention(*(t.transpose(1, 2) for t in (q, k, v)), alibi_slopes=slopes, layout="bsnd")
    torch.testing.assert_close(out_bsnd.transpose(1, 2), out)

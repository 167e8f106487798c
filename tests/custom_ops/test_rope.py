"""``auto_deploy::torch_rope_with_explicit_cos_sin`` against HF's apply_rotary_pos_emb (the plain math)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

rope = torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin


def _cos_sin(batch, seq, rot_dim, dtype=torch.float32, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    pos = torch.arange(seq, dtype=torch.float32).expand(batch, seq)
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _reference(q, k, cos, sin, unsqueeze_dim):
    """HF's partial-rotary convention (StableLM/Phi): rotate the first rot_dim features, pass the rest."""
    rot = cos.shape[-1]
    q_embed, k_embed = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin, unsqueeze_dim=unsqueeze_dim)
    return torch.cat((q_embed, q[..., rot:]), dim=-1), torch.cat((k_embed, k[..., rot:]), dim=-1)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("rot_dim", [16, 8, 4])  # full and partial rotary (head_dim 16)
def test_matches_hf_math(unsqueeze_dim, rot_dim):
    torch.manual_seed(0)
    b, s, nq, nk, d = 2, 5, 4, 2, 16
    shape = (lambda n: (b, n, s, d)) if unsqueeze_dim == 1 else (lambda n: (b, s, n, d))
    q, k = torch.randn(shape(nq)), torch.randn(shape(nk))
    cos, sin = _cos_sin(b, s, rot_dim)
    q_out, k_out = rope(q, k, cos, sin, unsqueeze_dim)
    q_ref, k_ref = _reference(q, k, cos, sin, unsqueeze_dim)
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)
    if rot_dim < d:  # the pass-through part is untouched
        torch.testing.assert_close(q_out[..., rot_dim:], q[..., rot_dim:], rtol=0, atol=0)


def test_full_rotary_equals_llama_exactly_and_layouts_agree():
    torch.manual_seed(1)
    q, k = torch.randn(3, 4, 7, 8), torch.randn(3, 2, 7, 8)
    cos, sin = _cos_sin(3, 7, 8)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out = rope(q, k, cos, sin)  # unsqueeze_dim defaults to 1
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)
    # the same computation in [b, s, n, d]
    q2, k2 = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2)
    torch.testing.assert_close(q2.transpose(1, 2), q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k2.transpose(1, 2), k_ref, rtol=0, atol=0)


def test_broadcast_batch_and_bf16():
    torch.manual_seed(2)
    q, k = torch.randn(2, 4, 5, 8, dtype=torch.bfloat16), torch.randn(2, 4, 5, 8, dtype=torch.bfloat16)
    cos, sin = _cos_sin(1, 5, 8, dtype=torch.bfloat16)  # batch 1 broadcasts
    q_out, k_out = rope(q, k, cos, sin, 1)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)
    # fp32 cos/sin with bf16 q/k promote like the eager expression
    cos32, sin32 = _cos_sin(1, 5, 8)
    q_out, _ = rope(q, k, cos32, sin32, 1)
    assert q_out.dtype == torch.float32
    torch.testing.assert_close(q_out, apply_rotary_pos_emb(q, k, cos32, sin32)[0], rtol=0, atol=0)


@pytest.mark.parametrize("unsqueeze_dim,rot_dim", [(1, 16), (2, 8)])
def test_fake_impl_shapes(unsqueeze_dim, rot_dim):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        b, s, d = 2, 9, 16
        shape = (lambda n: (b, n, s, d)) if unsqueeze_dim == 1 else (lambda n: (b, s, n, d))
        q = torch.empty(shape(4), dtype=torch.bfloat16)
        k = torch.empty(shape(2), dtype=torch.bfloat16)
        cos = torch.empty(b, s, rot_dim, dtype=torch.bfloat16)
        q_out, k_out = rope(q, k, cos, cos, unsqueeze_dim)
        assert q_out.shape == q.shape and k_out.shape == k.shape
        assert q_out.dtype == k_out.dtype == torch.bfloat16
        q_out, _ = rope(q, k, cos.float(), cos.float(), unsqueeze_dim)
        assert q_out.dtype == torch.float32


def test_fake_impl_matches_real_and_op_checks():
    torch.library.opcheck(rope, (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), *_cos_sin(2, 5, 4), 1))


def test_bad_rotary_dim_rejected():
    q = torch.randn(1, 2, 3, 8)
    cos, sin = _cos_sin(1, 3, 16)
    with pytest.raises(ValueError, match="exceeds"):
        rope(q, q, cos, sin, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 8])
def test_interleaved_matches_gptj_math(rot_dim, dtype):
    """interleaved=True: GPT-J's rotate_every_two with repeat_interleaved cos/sin, [b, s, n, d] q/k."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope

    torch.manual_seed(3)
    b, s, d = 2, 5, 16
    q, k = torch.randn(b, s, 4, d, dtype=dtype), torch.randn(b, s, 2, d, dtype=dtype)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.arange(s, dtype=torch.float32).expand(b, s)[..., None] * inv_freq  # [b, s, rot/2]
    sin_h, cos_h = freqs.sin().to(dtype), freqs.cos().to(dtype)
    cos, sin = cos_h.repeat_interleave(2, -1), sin_h.repeat_interleave(2, -1)
    q_out, k_out = rope(q, k, cos, sin, 2, True)
    for out, x in ((q_out, q), (k_out, k)):
        ref = torch.cat((gptj_rope(x[..., :rot_dim], sin_h, cos_h), x[..., rot_dim:]), dim=-1)
        assert out.dtype == ref.dtype
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # fake implementation: shapes and dtypes
    with torch._subclasses.FakeTensorMode() as mode:
        fq, fk = rope(*(mode.from_tensor(t) for t in (q, k, cos, sin)), 2, True)
    assert fq.shape == q.shape and fk.shape == k.shape and fq.dtype == q_out.dtype

"""auto_deploy::rms_norm / add_rms_norm / silu_mul / rope: on every native build this CPU runs, float32 results
within rounding of the plain-torch references (the halves of a fused product read in place, partial rotary, a
shared cos/sin table), other dtypes with the references' own arithmetic, and the fake shapes."""

import pytest
import torch

from autodeploy.custom_ops.pointwise import add_rms_norm_reference, rope_bshd_reference, silu_mul_reference
from autodeploy.custom_ops.rmsnorm import rmsnorm_reference

ops = torch.ops.auto_deploy


def _close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out - ref).abs().max() <= rel * ref.abs().max(), (out - ref).abs().max()


@pytest.mark.parametrize("rows,dim", [(1, 768), (7, 13), (128, 768), (3, 4096)])
def test_rms_norm_is_the_reference_within_rounding(kernels, rows, dim):
    torch.manual_seed(rows)
    x = torch.randn(2, rows, dim) * 3
    weight = torch.randn(dim)
    for w in (weight, None):
        _close(ops.rms_norm(x, w, 1e-6), rmsnorm_reference(x, w, 1e-6), 2e-6)
    # a strided input (every other row) is read in place
    _close(ops.rms_norm(x[:, ::2], weight, 1e-5), rmsnorm_reference(x[:, ::2], weight, 1e-5), 2e-6)


@pytest.mark.parametrize("rows,dim", [(1, 768), (7, 13), (128, 768)])
def test_add_rms_norm_is_the_sum_and_its_norm(kernels, rows, dim):
    torch.manual_seed(dim)
    x, residual, weight = torch.randn(rows, 2 * dim)[:, :dim], torch.randn(rows, dim), torch.randn(dim)
    for w in (weight, None):
        total, normed = ops.add_rms_norm(x, residual, w, 1e-6)
        ref_total, ref_normed = add_rms_norm_reference(x, residual, w, 1e-6)
        assert torch.equal(total, ref_total)  # one float32 add, as torch's
        _close(normed, ref_normed, 2e-6)


@pytest.mark.parametrize("rows,n", [(1, 2048), (5, 13), (128, 2048)])
def test_silu_mul_reads_the_halves_of_a_fused_product(kernels, rows, n):
    torch.manual_seed(n)
    fused = torch.randn(2, rows, 2 * n) * 4
    gate, up = fused.split(n, -1)  # views with rows 2n apart
    _close(ops.silu_mul(gate, up), silu_mul_reference(gate, up), 2e-6)
    big = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0]])  # exp's range ends
    _close(ops.silu_mul(big, torch.ones_like(big)), silu_mul_reference(big, torch.ones_like(big)), 1e-6)


@pytest.mark.parametrize("batch,seq,heads,kv_heads,head_dim,rot,shared",
                         [(1, 128, 12, 4, 64, 64, True), (2, 5, 3, 1, 80, 32, False), (2, 3, 2, 2, 64, 20, True),
                          (1, 1, 4, 2, 128, 128, True)])
def test_rope_matches_the_canonical_op(kernels, batch, seq, heads, kv_heads, head_dim, rot, shared):
    torch.manual_seed(seq)
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * head_dim)  # q and k as views of a fused product
    q = qkv[..., : heads * head_dim].view(batch, seq, heads, head_dim)
    k = qkv[..., heads * head_dim: (heads + kv_heads) * head_dim].view(batch, seq, kv_heads, head_dim)
    cos, sin = torch.randn(1 if shared else batch, seq, rot), torch.randn(1 if shared else batch, seq, rot)
    for out, ref in zip(ops.rope(q, k, cos, sin),
                        ops.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)):
        _close(out, ref, 1e-6)


def test_other_dtypes_take_the_references_arithmetic():
    torch.manual_seed(0)
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5))
    assert torch.equal(ops.silu_mul(x, x), silu_mul_reference(x, x))
    for out, ref in zip(ops.add_rms_norm(x, x, w, 1e-5), add_rms_norm_reference(x, x, w, 1e-5)):
        assert torch.equal(out, ref)
    q, k = torch.randn(1, 3, 2, 8, dtype=torch.bfloat16), torch.randn(1, 3, 1, 8, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    for out, ref in zip(ops.rope(q, k, cos, sin), rope_bshd_reference(q, k, cos, sin)):
        assert out.dtype == ref.dtype == torch.float32 and torch.equal(out, ref)


def test_fake_shapes():
    with torch._subclasses.FakeTensorMode():
        x, w = torch.empty(2, 5, 16), torch.empty(16)
        assert ops.rms_norm(x, w, 1e-6).shape == (2, 5, 16)
        assert ops.silu_mul(x, x).shape == (2, 5, 16)
        assert [t.shape for t in ops.add_rms_norm(x, x, w, 1e-6)] == [(2, 5, 16)] * 2
        q, k = ops.rope(torch.empty(1, 5, 4, 16), torch.empty(1, 5, 2, 16), torch.empty(1, 5, 16),
                        torch.empty(1, 5, 16))
        assert q.shape == (1, 5, 4, 16) and k.shape == (1, 5, 2, 16)

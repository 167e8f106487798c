"""auto_deploy::torch_int8_linear and quantize_per_channel_int8: round-trip error, dtypes, numerics
against an fp32 reference over the dequantized weight, and the fake (meta) implementation."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops.quant_linear import quantize_per_channel_int8

int8_linear = torch.ops.auto_deploy.torch_int8_linear


def _weight(n=48, k=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: per-row scales must really be per row
    rows_scale = torch.logspace(-3, 1, n)[:, None]
    return (torch.randn(n, k, generator=gen) * rows_scale).to(dtype)


def _dequant(q, scale):
    return q.float() * scale.float()[:, None]


# -- quantize_per_channel_int8 ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_round_trip_within_half_step_and_original_untouched(dtype):
    weight = _weight(dtype=dtype)
    original = weight.clone()
    q, scale = quantize_per_channel_int8(weight)
    assert torch.equal(weight, original)  # the input is never edited in place (fp32: the chunk copy)
    assert q.dtype == torch.int8 and q.shape == weight.shape
    assert scale.dtype == torch.bfloat16 and scale.shape == (weight.shape[0],)
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    # each row uses the full range: the largest |w| of the row maps to +-127
    assert torch.equal(q.abs().amax(dim=1), torch.full((weight.shape[0],), 127, dtype=torch.int8))
    step = scale.float()[:, None]
    err = (_dequant(q, scale) - weight.float()).abs()
    assert bool((err <= step * (0.5 + 1e-5)).all()), float((err / step).max())
    # per-row scale: small rows keep small absolute errors (a single global scale would not)
    assert float(err[0].max()) < 1e-4 < float(err[-1].max())


def test_quantize_in_chunks_and_zero_rows(monkeypatch):
    import autodeploy.custom_ops.quant_linear as ql

    weight = _weight(n=10, k=16)
    weight[3] = 0.0
    full_q, full_scale = quantize_per_channel_int8(weight)
    monkeypatch.setattr(ql, "_ROWS_PER_CHUNK", 3)  # chunks of 3 rows, the last one partial
    q, scale = ql.quantize_per_channel_int8(weight)
    assert torch.equal(q, full_q) and torch.equal(scale, full_scale)
    assert torch.equal(q[3], torch.zeros(16, dtype=torch.int8)) and bool(torch.isfinite(scale).all())
    assert bool((scale > 0).all())


# -- torch_int8_linear ----------------------------------------------------------------------------
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_shape", [(5, 64), (2, 7, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_against_fp32_reference(x_dtype, x_shape, with_bias):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=gen) * torch.logspace(-2, 0, 48)[:, None]  # rows of different scales
    q, scale = quantize_per_channel_int8(weight)
    x = torch.randn(x_shape, generator=gen).to(x_dtype)
    bias = (torch.randn(48, generator=gen) * 4).to(x_dtype) if with_bias else None
    out = int8_linear(x, q, scale, bias)
    assert out.dtype == x_dtype and out.shape == (*x_shape[:-1], 48)

    w_deq = _dequant(q, scale)
    ref = x.float() @ w_deq.T + (bias.float() if with_bias else 0.0)
    ref_scale = float(ref.abs().max())
    err = float((out.float() - ref).abs().max())
    # the kernel rounds the activations to bf16 (relative error 2^-9 per element) and its output to
    # bf16, accumulating in fp32; a bf16 x / output adds one more rounding of the same size. A few
    # 2^-9 relative errors on an output of this size: 1e-2 of the reference's scale is a safe bound.
    assert err <= 1e-2 * ref_scale, (err, ref_scale)
    # ... and the bound is tight enough to reject wrong answers: a transposed-scale / missing-bias /
    # unscaled result is off by far more than that
    wrong_scale = x.float() @ (q.float() * scale.float().flip(0)[:, None]).T + (bias.float() if with_bias else 0.0)
    assert float((out.float() - wrong_scale).abs().max()) > 10 * 1e-2 * ref_scale
    if with_bias:  # a dropped bias
        assert float((out.float() - (ref - bias.float())).abs().max()) > 10 * 1e-2 * ref_scale
    # and it approximates the unquantized linear (weight error <= half a step per element)
    full = torch.nn.functional.linear(x.float(), weight, bias.float() if with_bias else None)
    assert float((out.float() - full).abs().max()) <= 2e-2 * float(full.abs().max())


def test_int8_linear_rows_are_independent():
    """Flattening the leading dims must not mix rows: batch of 3 = three batches of 1."""
    gen = torch.Generator().manual_seed(2)
    q, scale = quantize_per_channel_int8(torch.randn(24, 32, generator=gen))
    x = torch.randn(3, 4, 32, generator=gen)
    full = int8_linear(x, q, scale)
    for i in range(3):
        torch.testing.assert_close(int8_linear(x[i : i + 1], q, scale), full[i : i + 1], atol=0, rtol=0)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fake_tensor_shape_and_dtype(x_dtype, with_bias):
    with FakeTensorMode():
        x = torch.empty(2, 7, 64, dtype=x_dtype)
        q = torch.empty(48, 64, dtype=torch.int8)
        scale = torch.empty(48, dtype=torch.bfloat16)
        bias = torch.empty(48, dtype=x_dtype) if with_bias else None
        out = int8_linear(x, q, scale, bias)
    assert out.shape == (2, 7, 48) and out.dtype == x_dtype
    # the fake result agrees with the real one
    real = int8_linear(torch.randn(2, 7, 64).to(x_dtype), torch.ones(48, 64, dtype=torch.int8),
                       torch.ones(48, dtype=torch.bfloat16), torch.zeros(48, dtype=x_dtype) if with_bias else None)
    assert real.shape == out.shape and real.dtype == out.dtype


def test_opcheck():
    gen = torch.Generator().manual_seed(3)
    q, scale = quantize_per_channel_int8(torch.randn(16, 32, generator=gen))
    x, bias = torch.randn(2, 3, 32, generator=gen), torch.randn(16, generator=gen)
    torch.library.opcheck(int8_linear.default, (x, q, scale, bias))
    torch.library.opcheck(int8_linear.default, (x.bfloat16(), q, scale, None))


# -- the prompt path and the torch.compile form --------------------------------------------------
def _dequant_reference(x, q, scale, bias=None):
    out = x.double() @ (q.double() * scale.double()[:, None]).T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("with_bias", [False, True])
def test_prompt_sized_input_uses_dequantized_chunks_in_fp32(monkeypatch, with_bias):
    """From DEQUANT_MIN_ROWS rows on the product is dense fp32 over dequantized weight chunks: exact to
    fp32 rounding (far tighter than the bf16 kernel), the chunks (3 of 7 rows, the last partial) in order."""
    import autodeploy.custom_ops.quant_linear as ql

    monkeypatch.setattr(ql, "_DEQUANT_CHUNK_ELEMS", 3 * 64)
    gen = torch.Generator().manual_seed(4)
    q, scale = quantize_per_channel_int8(_weight(n=7, k=64, seed=4))
    bias = torch.randn(7, generator=gen) if with_bias else None
    x = torch.randn(ql.DEQUANT_MIN_ROWS, 64, generator=gen)
    out = int8_linear(x, q, scale, bias)
    ref = _dequant_reference(x, q, scale, bias)
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    # one row fewer takes the bf16 kernel, whose error is orders of magnitude above that bound
    kernel = int8_linear(x[1:], q, scale, bias)
    assert float((kernel.double() - ref[1:]).abs().max()) > 1e-4 * float(ref.abs().max())


def test_compile_form_one_row_is_an_fp32_multiply_and_sum_more_rows_the_op():
    from autodeploy.custom_ops.quant_linear import int8_linear_for_compile

    gen = torch.Generator().manual_seed(5)
    q, scale = quantize_per_channel_int8(_weight(n=24, k=64, seed=5))
    bias = torch.randn(24, generator=gen)
    one = torch.randn(1, 1, 64, generator=gen)
    out = int8_linear_for_compile(one, q, scale, bias)
    ref = _dequant_reference(one, q, scale, bias)
    assert out.shape == (1, 1, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    wrong = _dequant_reference(one, q, scale.flip(0), bias)  # the bound rejects a mis-scaled result
    assert float((out.double() - wrong).abs().max()) > 1e-5 * float(ref.abs().max())
    two = torch.randn(1, 2, 64, generator=gen)
    torch.testing.assert_close(int8_linear_for_compile(two, q, scale, bias), int8_linear(two, q, scale, bias),
                               atol=0, rtol=0)
    compiled = torch.compile(int8_linear_for_compile, fullgraph=True)
    torch.testing.assert_close(compiled(one, q, scale, bias), out, atol=1e-5 * float(ref.abs().max()), rtol=0)

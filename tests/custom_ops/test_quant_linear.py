"""auto_deploy::torch_int8_linear and quantize_per_channel_int8: round-trip error, dtypes, numerics
against an fp32 reference over the dequantized weight, and the fake (meta) implementation."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops import native
from autodeploy.custom_ops.quant_linear import (
    INT8_GEMV_VS_TORCH_RTOL,
    NATIVE_MAX_ROWS,
    int8_gemv_reference,
    quantize_per_channel_int8,
)

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


@pytest.mark.parametrize("rows_per_batch, k", [(2, 64), (2, 32), (8, 32)])  # native / bf16 kernel / split GEMM
def test_int8_linear_rows_are_independent(rows_per_batch, k):
    """Flattening the leading dims must not mix rows: a batch's result does not depend on the other batches
    beside it (the path depends on the number of rows, so both calls have all of them). On the x86 builds a
    decode-sized call and a prompt-sized one also agree bit for bit (the pair products' sums are the kernel's
    exact integer sums), so there a batch of 3 is three batches of 1; elsewhere more than NATIVE_MAX_ROWS rows
    take another float32 path."""
    gen = torch.Generator().manual_seed(2)
    q, scale = quantize_per_channel_int8(torch.randn(24, k, generator=gen))
    x = torch.randn(3, rows_per_batch, k, generator=gen)
    full = int8_linear(x, q, scale)
    for i in range(3):
        alone = torch.zeros_like(x)
        alone[i] = x[i]
        torch.testing.assert_close(int8_linear(alone, q, scale)[i], full[i], atol=0, rtol=0)
        if native.pair_products():
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


def _int8_gemm_is_exact() -> bool:
    """Whether torch._int_mm sums exactly here: products that saturate vpmaddubsw's 16-bit pair sums."""
    a, b = torch.full((32, 64), 127, dtype=torch.int8), torch.full((64, 32), 127, dtype=torch.int8)
    return torch.equal(torch._int_mm(a, b), torch.full((32, 32), 64 * 127 * 127, dtype=torch.int32))


@pytest.mark.parametrize("with_bias", [False, True])
def test_prompt_sized_input_is_an_exact_product_of_15_bit_activations(with_bias, monkeypatch):
    """From SPLIT_MIN_ROWS rows on (beyond the native kernel's rows), on a CPU with VNNI, the product is one
    int8 GEMM over activations rounded to 15 bits per row and split into two int8 halves: within 2^-15 of
    each row's largest value per element, far tighter than the bf16 kernel."""
    import autodeploy.custom_ops.quant_linear as ql

    if not _int8_gemm_is_exact():
        pytest.skip("torch's int8 GEMM saturates here (oneDNN capped below VNNI, e.g. ONEDNN_MAX_CPU_ISA=AVX2, on a "
                    "CPU with it); the split path runs only where the CPU has VNNI")
    monkeypatch.setattr(ql, "int8_gemm_is_fast", lambda: True)
    gen = torch.Generator().manual_seed(4)
    q, scale = quantize_per_channel_int8(_weight(n=7, k=64, seed=4))
    bias = torch.randn(7, generator=gen) if with_bias else None
    rows = max(ql.SPLIT_MIN_ROWS, ql.NATIVE_MAX_ROWS + 1)
    x = torch.randn(rows, 64, generator=gen) * torch.logspace(-2, 2, rows)[:, None]  # per-row ranges
    out = int8_linear(x, q, scale, bias)
    ref = _dequant_reference(x, q, scale, bias)
    # per row: 64 products, each off by at most half a step (amax / 32766) times |w|
    bound = 64 * (x.abs().amax(1, keepdim=True).double() / 32766) * _dequant(q, scale).abs().amax().double()
    assert bool(((out.double() - ref).abs() <= bound).all())
    assert float((out.double() - ref).abs().max()) > 0  # it really rounds the activations
    # and the bound rejects a mis-scaled result or halves combined the wrong way round
    wrong = _dequant_reference(x, q, scale.flip(0), bias)
    assert bool(((wrong - ref).abs() > bound).any())
    plain = (x @ q.float().T).double()
    swapped = ql._split_activation_mm(x.flip(1), q, scale).double()
    assert not torch.allclose(swapped, plain * scale.double(), atol=0, rtol=0)
    # the same rows through the bf16 kernel are more than an order of magnitude less precise
    kernel = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, scale).double() + (bias.double() if with_bias else 0)
    assert float((kernel - ref).abs().max()) > 20 * float((out.double() - ref).abs().max())


@pytest.mark.slow  # compiles with Inductor
def test_compile_forms_decode_and_prompt():
    """The decode form of one row is the native kernel's op, else an fp32 multiply-and-sum; the prompt form
    is the split-activation GEMM in plain torch; all agree with a float64 reference and compile in one graph."""
    import autodeploy.custom_ops.quant_linear as ql
    from autodeploy.custom_ops import native

    gen = torch.Generator().manual_seed(5)
    q, scale = quantize_per_channel_int8(_weight(n=24, k=64, seed=5))
    bias = torch.randn(24, generator=gen)
    one = torch.randn(1, 1, 64, generator=gen)
    ref = _dequant_reference(one, q, scale, bias)
    tol = 1e-4 * float(ref.abs().max())  # 16-bit activations in the native kernel; exact fp32 otherwise
    decode = ql.int8_linear_for_compile(decode=True)
    out = decode(one, q, scale, bias)
    assert out.shape == (1, 1, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    wrong = _dequant_reference(one, q, scale.flip(0), bias)  # the bound rejects a mis-scaled result
    assert float((out.double() - wrong).abs().max()) > tol
    compiled = torch.compile(decode, fullgraph=True)
    torch.testing.assert_close(compiled(one, q, scale, bias).double(), ref, atol=tol, rtol=0)
    if native.int8_gemv_available():  # the native op is what the decode graph calls
        from torch.fx.experimental.proxy_tensor import make_fx

        assert "auto_deploy.int8_gemv" in str(make_fx(decode)(one, q, scale, bias).graph)  # one row: the kernel
    prompt_x = torch.randn(1, 40, 64, generator=gen)
    prompt = ql.int8_linear_for_compile(decode=False)
    ref = _dequant_reference(prompt_x, q, scale, bias)
    torch.testing.assert_close(prompt(prompt_x, q, scale, bias).double(), ref, atol=1e-4 * float(ref.abs().max()),
                               rtol=0)
    compiled = torch.compile(prompt, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(prompt_x, q, scale, bias).double(), ref,
                               atol=1e-4 * float(ref.abs().max()), rtol=0)


def _prompt_without_vnni(compiled, monkeypatch, pair_products: bool, seed: int):
    """A 24-row prompt product of int8 weights [40, 64] on a CPU without VNNI, with or without the native
    build's pair products, through the op or its compile form: (x, q, scale, bias, out)."""
    import autodeploy.custom_ops.quant_linear as ql
    from autodeploy.custom_ops import native

    monkeypatch.setattr(ql, "int8_gemm_is_fast", lambda: False)
    monkeypatch.setattr(native, "pair_products", lambda: pair_products)
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize_per_channel_int8(_weight(n=40, k=64, seed=seed))
    bias = torch.randn(40, generator=gen)
    x = torch.randn(1, 24, 64, generator=gen)
    product = ql.int8_linear_for_compile(decode=False) if compiled else int8_linear
    return x, q, scale, bias, product(x, q, scale, bias)


@pytest.mark.parametrize("compiled", [False, True])
def test_prompts_without_vnni_take_the_pair_products_of_x86_builds(compiled, monkeypatch):
    """Without VNNI, where the native build has pair products (AVX2, AVX-512), prompts are ``int8_gemv``'s exact
    integer products: its reference bit for bit, the op and its compile form alike."""
    import autodeploy.custom_ops.quant_linear as ql
    from autodeploy.custom_ops import native

    if not native.int8_gemv_available():
        pytest.skip("the native kernels do not run here")
    x, q, scale, bias, out = _prompt_without_vnni(compiled, monkeypatch, pair_products=True, seed=9)
    assert torch.equal(out, ql.int8_gemv_reference(x, q, scale) + bias)


@pytest.mark.parametrize("compiled", [False, True])
def test_prompts_without_vnni_take_the_dequantized_float32_product(compiled, monkeypatch):
    """Without VNNI (torch's int8 GEMM has no fast path there) and without pair products (ARM, or no native
    kernels) prompts multiply in float32 over the dequantized weight (``int8_mm``: the native kernel where it
    runs, else a block of rows at a time): the dequantized product to float32 rounding, the op and its
    compile form alike, past one block of rows too."""
    import autodeploy.custom_ops.half_linear as hl

    monkeypatch.setattr(hl, "ROWS_PER_BLOCK", 16)  # 40 output rows: three blocks
    x, q, scale, bias, out = _prompt_without_vnni(compiled, monkeypatch, pair_products=False, seed=8)
    ref = _dequant_reference(x, q, scale, bias)
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    assert not torch.allclose(out.double(), _dequant_reference(x, q, scale.flip(0), bias), atol=1e-3, rtol=0)


def test_compile_form_without_native_kernel(monkeypatch):
    """Without the native library a one-row decode product is an fp32 multiply-and-sum (exact to fp32
    rounding), and more rows keep the op."""
    import autodeploy.custom_ops.quant_linear as ql
    from autodeploy.custom_ops import native

    monkeypatch.setattr(native, "int8_gemv_available", lambda: False)
    gen = torch.Generator().manual_seed(6)
    q, scale = quantize_per_channel_int8(_weight(n=24, k=64, seed=6))
    one, two = torch.randn(1, 1, 64, generator=gen), torch.randn(1, 2, 64, generator=gen)
    decode = ql.int8_linear_for_compile(decode=True)
    ref = _dequant_reference(one, q, scale)
    torch.testing.assert_close(decode(one, q, scale).double(), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    torch.testing.assert_close(decode(two, q, scale), int8_linear(two, q, scale), atol=0, rtol=0)


def test_int8_product_op_is_the_ops_product_without_bias_and_cast():
    """auto_deploy::int8_product (the low-overhead call of compiled decode graphs where the native kernel
    runs) is ``int8_gemv`` up to NATIVE_MAX_ROWS rows and the split GEMM beyond, in float32: where the kernel
    runs, exactly the op's product without bias; elsewhere ``int8_gemv``'s plain-torch implementation."""
    gen = torch.Generator().manual_seed(7)
    q, scale = quantize_per_channel_int8(_weight(n=24, k=64, seed=7))
    for rows in (1, 5, 40):  # int8_gemv, int8_gemv, split GEMM
        x = torch.randn(1, rows, 64, generator=gen)
        out = torch.ops.auto_deploy.int8_product(x, q, scale)
        assert out.dtype == torch.float32 and out.shape == (1, rows, 24)
        if rows <= NATIVE_MAX_ROWS:
            torch.testing.assert_close(out, torch.ops.auto_deploy.int8_gemv(x, q, scale), atol=0, rtol=0)
        if rows > NATIVE_MAX_ROWS or native.int8_gemv_available():
            torch.testing.assert_close(out, int8_linear(x, q, scale), atol=0, rtol=0)
    torch.library.opcheck(torch.ops.auto_deploy.int8_product.default, (x, q, scale))


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_gemv_reference_is_the_kernels_arithmetic(rows):
    """``auto_deploy::int8_gemv`` runs everywhere: its plain-torch implementation has the native kernel's
    arithmetic (16-bit activations, exact integer dot products), so where the kernel runs the two agree
    bit for bit; torch's int8 kernel (bfloat16 activations, the path without the native kernel) stays
    within INT8_GEMV_VS_TORCH_RTOL of the output's largest magnitude."""
    gen = torch.Generator().manual_seed(rows)
    q, scale = quantize_per_channel_int8(torch.randn(200, 256, generator=gen))
    x = torch.randn(rows, 256, generator=gen) * torch.logspace(-2, 1, rows)[:, None]
    reference = int8_gemv_reference(x, q, scale)
    torch.testing.assert_close(torch.ops.auto_deploy.int8_gemv(x, q, scale), reference, atol=0, rtol=0)
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()
    assert (reference.double() - exact).abs().max() <= 2e-4 * exact.abs().max()  # 16-bit activations
    bf16 = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, scale).float()
    error = (bf16 - reference).abs().amax(dim=-1) / reference.abs().amax(dim=-1)
    assert float(error.max()) <= INT8_GEMV_VS_TORCH_RTOL
    torch.library.opcheck(torch.ops.auto_deploy.int8_gemv.default, (x, q, scale))

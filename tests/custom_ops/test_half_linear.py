"""auto_deploy::half_linear: float32 arithmetic over 16-bit weights (against a float64 reference over the
weight's exact values), blockwise weight conversion, bias, dtypes, the fake implementation and the compile
form, and its product-registry entry."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
import autodeploy.custom_ops.half_linear as hl
from autodeploy.utils.products import product_ops

half_linear = torch.ops.auto_deploy.half_linear


def _case(n=48, k=64, w_dtype=torch.bfloat16, x_dtype=torch.float32, x_shape=(5, 64), seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]).to(w_dtype)
    x = torch.randn(x_shape, generator=gen).to(x_dtype)
    bias = torch.randn(n, generator=gen).to(x_dtype)
    return x, weight, bias


def _reference(x, weight, bias=None):
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_shape", [(1, 64), (5, 64), (2, 7, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_half_linear_against_float64(w_dtype, x_dtype, x_shape, with_bias):
    x, weight, bias = _case(w_dtype=w_dtype, x_dtype=x_dtype, x_shape=x_shape)
    bias = bias if with_bias else None
    out = half_linear(x, weight, bias)
    assert out.dtype == x_dtype and out.shape == (*x_shape[:-1], 48)
    ref = _reference(x, weight, bias)
    scale = float(ref.abs().max())
    err = float((out.double() - ref).abs().max())
    if x_dtype == torch.float32:
        # float32 accumulation over the exact 16-bit weights: float32 rounding only (K=64 terms)
        assert err <= 1e-6 * scale, err
    else:
        # float32 product, rounded once to the bf16 output (2^-9 relative)
        assert err <= 2**-8 * scale, err
    # fp32 activations are not rounded to 16 bits: torch's bf16 GEMM is far less precise
    if x_dtype == torch.float32 and w_dtype == torch.bfloat16:
        coarse = torch.nn.functional.linear(x.bfloat16(), weight, None if bias is None else bias.bfloat16())
        assert float((coarse.double() - ref).abs().max()) > 20 * max(err, 1e-9 * scale)


def test_blockwise_conversion_matches_one_block(monkeypatch):
    """More output rows than a block: converted and multiplied block by block, the same result."""
    x, weight, bias = _case(n=50, x_shape=(3, 64), seed=1)
    whole = half_linear(x, weight, bias)
    converted = []
    original = torch.Tensor.float

    def spy(t):
        converted.append(t.shape)
        return original(t)

    monkeypatch.setattr(hl, "ROWS_PER_BLOCK", 16)
    monkeypatch.setattr(torch.Tensor, "float", spy)
    out = hl.half_linear_reference(x, weight, bias)
    monkeypatch.undo()
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-6)
    blocks = [s for s in converted if len(s) == 2 and s[1] == 64 and s[0] != 3]  # the weight's blocks
    assert [s[0] for s in blocks] == [16, 16, 16, 2]  # never the whole weight


def test_rejects_float32_weights_and_fake_shapes():
    x, weight, _ = _case()
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        hl.half_linear_reference(x, weight.float())
    with FakeTensorMode() as mode:
        fx_ = mode.from_tensor(torch.empty(2, 9, 64))
        fw = mode.from_tensor(weight)
        out = half_linear(fx_, fw)
    assert out.shape == (2, 9, 48) and out.dtype == torch.float32


def test_registered_as_a_dense_product_with_a_compile_form():
    entry = next(p for p in product_ops() if p.op == half_linear.default)
    assert entry is hl.HALF_LINEAR and entry.dense and entry.row_args == ("weight",)
    assert entry.compile_form is not None


def test_compile_form_decode_row_and_others():
    x, weight, bias = _case(x_shape=(1, 1, 64), seed=3)
    decode = hl.half_linear_for_compile(decode=True)
    ref = _reference(x, weight, bias)
    torch.testing.assert_close(decode(x, weight, bias).double(), ref, atol=1e-6 * float(ref.abs().max()), rtol=0)
    more = torch.randn(1, 4, 64)
    assert torch.equal(decode(more, weight, bias), half_linear(more, weight, bias))  # the op itself
    prompt = hl.half_linear_for_compile(decode=False)
    assert torch.equal(prompt(x, weight, bias), half_linear(x, weight, bias))


@pytest.mark.parametrize("has_native", [False, True])
def test_decode_form_calls_the_native_kernel_where_it_runs(has_native, monkeypatch):
    """Where the native kernels run, a decode row keeps the op (its CPU implementation is the kernel);
    elsewhere it is the multiply-and-sum Inductor fuses into one loop."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autodeploy.custom_ops import native

    monkeypatch.setattr(native, "half_linear_available", lambda: has_native)
    x, weight, bias = _case(x_shape=(1, 1, 64), seed=5)
    graph = str(make_fx(hl.half_linear_for_compile(decode=True))(x, weight, bias).graph)
    assert ("auto_deploy.half_linear" in graph) == has_native

"""auto_deploy::half_packed_linear: bfloat16 and float16 weights in the panels of f32_packed_linear, every build's
kernel against a float64 product over the weights' exact values, at decode and prompt row counts; a row's result
does not depend on the rows beside it; inputs the kernel does not take go to half_linear's plain-torch product."""

import pytest
import torch

from autodeploy.custom_ops import native
from autodeploy.custom_ops.half_linear import half_packed_linear_reference
from autodeploy.custom_ops.linear import PANEL_ROWS, pack_f32_panels

DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 40, 600])  # one pass, several, passes over two panels (AVX-512),
# groups of 512 rows
@pytest.mark.parametrize("n, k", [(1, 16), (37, 48), (48, 1040)])  # a panel's tail; chunks of 256 and a tail chunk
def test_half_packed_linear_against_float64(dtype, rows, n, k, kernels):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    weight = (torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]).to(dtype)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    panels = pack_f32_panels(weight)
    assert panels.dtype == dtype
    out = torch.ops.auto_deploy.half_packed_linear(x, panels, n)
    exact = weight.double()  # both 16-bit formats widen to float32 (and float64) exactly
    ref = x.double() @ exact.T
    assert out.shape == (rows, n) and out.dtype == torch.float32
    bound = 4 * k * 2**-24 * (x.double().abs() @ exact.abs().T)
    assert bool(((out.double() - ref).abs() <= bound).all())
    assert bool(((x[:, :-16].double() @ exact[:, :-16].T - ref).abs() > bound).any())


def test_a_rows_product_does_not_depend_on_the_rows_beside_it(kernels):
    gen = torch.Generator().manual_seed(5)
    panels = pack_f32_panels(torch.randn(40, 1040, generator=gen).bfloat16())
    x = torch.randn(600, 1040, generator=gen)
    together = torch.ops.auto_deploy.half_packed_linear(x, panels, 40)
    for rows in (2, 3, 16, 17, 40):
        assert torch.equal(torch.ops.auto_deploy.half_packed_linear(x[:rows], panels, 40), together[:rows]), rows
    alone = torch.ops.auto_deploy.half_packed_linear(x[:1], panels, 40)  # two chains of sums
    torch.testing.assert_close(alone, together[:1], atol=1e-4, rtol=1e-5)


def test_inputs_the_kernel_does_not_take_get_the_plain_product(kernels):
    weight, bias = torch.randn(20, 32).bfloat16(), torch.randn(20)
    panels = pack_f32_panels(weight)
    x = torch.randn(2, 3, 32)
    out = torch.ops.auto_deploy.half_packed_linear(x, panels, 20, bias)
    torch.testing.assert_close(out, x @ weight.float().T + bias, atol=1e-5, rtol=1e-5)
    half_x = x.bfloat16()  # bfloat16 activations: float32 arithmetic, the result in x's dtype
    assert torch.equal(torch.ops.auto_deploy.half_packed_linear(half_x, panels, 20),
                       half_packed_linear_reference(half_x, panels, 20))
    strided = torch.cat([panels, panels], dim=2)[:, :, :PANEL_ROWS]
    torch.testing.assert_close(torch.ops.auto_deploy.half_packed_linear(x, strided, 20), x @ weight.float().T,
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="needs x"):
        torch.ops.auto_deploy.half_packed_linear(x, panels.float(), 20)
    torch.library.opcheck(torch.ops.auto_deploy.half_packed_linear.default, (torch.randn(3, 32), panels, 20, bias))


def test_the_reference_names_bad_panels():
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        half_packed_linear_reference(torch.randn(1, 8), torch.randn(1, 8, PANEL_ROWS), 16)
    with pytest.raises(ValueError, match="does not fit 1 panels"):
        half_packed_linear_reference(torch.randn(1, 8), torch.randn(1, 8, PANEL_ROWS).bfloat16(), 17)


def test_only_the_avx2_build_asks_for_16_bit_panels():
    if native.library() is None:
        pytest.skip("the native kernels do not build or load here")
    assert native.half_pack_width() == {"AVX2": PANEL_ROWS}.get(native.capability(), 0)

"""auto_deploy::f32_packed_linear: float32 weights packed in panels of 16 rows (pack_f32_panels), every build's
kernel against a float64 reference to float32 rounding, at decode and prompt row counts; a row's result does not
depend on the rows beside it; inputs the kernel does not take go to torch's linear of the unpacked weight."""

import pytest
import torch

from autodeploy.custom_ops import native
from autodeploy.custom_ops.linear import PANEL_ROWS, f32_packed_linear_reference, pack_f32_panels, unpack_f32_panels


def test_panels_hold_each_row_k_major_and_unpack_to_the_weight():
    weight = torch.randn(37, 24)
    panels = pack_f32_panels(weight)
    assert panels.shape == (3, 24, PANEL_ROWS) and panels.is_contiguous()
    assert torch.equal(panels[1, 5, 3], weight[PANEL_ROWS + 3, 5])
    assert torch.equal(panels[2, :, 5:], torch.zeros(24, PANEL_ROWS - 5))  # rows past N are zero
    assert torch.equal(unpack_f32_panels(panels, 37), weight)
    with pytest.raises(ValueError, match=r"does not fit 3 panels"):
        f32_packed_linear_reference(torch.randn(1, 24), panels, 48 + 1)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 30, 40, 600])  # one pass (16 rows on AVX-512, 6 on AVX2), passes
# over two panels and their tails, groups of 512 rows
@pytest.mark.parametrize("n, k", [(1, 16), (37, 48), (21, 37), (200, 768), (48, 1040)])  # a panel's tail; an odd K
# (the one-row pass's last k); chunks of 256 and a tail chunk; an odd panel left over from the pairs
def test_f32_packed_linear_against_float64(rows, n, k, kernels):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    bias = torch.randn(n, generator=gen)
    out = torch.ops.auto_deploy.f32_packed_linear(x, pack_f32_panels(weight), n)
    ref = x.double() @ weight.double().T
    assert out.shape == (rows, n) and out.dtype == torch.float32
    bound = 4 * k * 2**-24 * (x.double().abs() @ weight.double().abs().T)  # a few ulps of the sum of magnitudes
    assert bool(((out.double() - ref).abs() <= bound).all())
    # tight enough to reject a product that drops the last 16 columns of k, or a shifted output row
    assert bool(((x[:, :-16].double() @ weight[:, :-16].double().T - ref).abs() > bound).any())
    if n > 1:
        assert bool(((ref.roll(1, dims=1) - ref).abs() > bound).any())
    with_bias = torch.ops.auto_deploy.f32_packed_linear(x, pack_f32_panels(weight), n, bias)
    assert torch.equal(with_bias, out + bias)


def test_a_rows_product_does_not_depend_on_the_rows_beside_it(kernels):
    """Each output is summed over k in order whatever pass computes it: a decode row beside any others and the
    same row in a prompt agree bit for bit (one row alone runs two chains of sums, within float32 rounding)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 1040, generator=gen)
    x = torch.randn(600, 1040, generator=gen)
    panels = pack_f32_panels(weight)
    together = torch.ops.auto_deploy.f32_packed_linear(x, panels, 40)
    for rows in (2, 3, 16, 17, 40):
        assert torch.equal(torch.ops.auto_deploy.f32_packed_linear(x[:rows], panels, 40), together[:rows]), rows
    alone = torch.ops.auto_deploy.f32_packed_linear(x[:1], panels, 40)
    torch.testing.assert_close(alone, together[:1], atol=1e-4, rtol=1e-5)


def test_the_operator_is_linear_for_any_input(kernels):
    """Inputs the kernel does not take (float64, a non-contiguous panel tensor) go to torch's linear over the
    unpacked weight; leading dims are kept."""
    weight, bias = torch.randn(20, 32), torch.randn(20)
    panels = pack_f32_panels(weight)
    x = torch.randn(2, 3, 32)
    out = torch.ops.auto_deploy.f32_packed_linear(x, panels, 20, bias)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert torch.ops.auto_deploy.f32_packed_linear(torch.randn(0, 32), panels, 20).shape == (0, 20)
    wide = pack_f32_panels(weight.double())
    assert torch.equal(torch.ops.auto_deploy.f32_packed_linear(x.double(), wide, 20),
                       torch.nn.functional.linear(x.double(), weight.double()))
    strided = torch.cat([panels, panels], dim=2)[:, :, :PANEL_ROWS]
    torch.testing.assert_close(torch.ops.auto_deploy.f32_packed_linear(x, strided, 20),
                               torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="needs x"):
        torch.ops.auto_deploy.f32_packed_linear(x, panels, 33)
    torch.library.opcheck(torch.ops.auto_deploy.f32_packed_linear.default, (torch.randn(3, 32), panels, 20, bias))


def test_only_the_x86_builds_ask_for_panels():
    if native.library() is None:
        pytest.skip("the native kernels do not build or load here")
    expected = {"AVX512": PANEL_ROWS, "AVX2": PANEL_ROWS}.get(native.capability(), 0)
    assert native.f32_pack_width() == expected

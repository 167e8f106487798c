"""auto_deploy::int4_linear and quantize_int4 / dequantize_int4: the packed layout, round-trip error bounds,
numerics against a float64 reference over the dequantized weight (fp32 and bf16 activations), blockwise
dequantization, the fake implementation, the compile form and the product-registry entry."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
import autodeploy.custom_ops.int4_linear as i4
from autodeploy.custom_ops import native
from autodeploy.custom_ops.int4_linear import dequantize_int4, quantize_int4, unpack_int4
from autodeploy.utils.products import product_ops

int4_linear = torch.ops.auto_deploy.int4_linear


def _weight(n=48, k=256, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None]).to(dtype)


def _rounding(x: torch.Tensor, weight: torch.Tensor) -> float:
    """How far the native decode products may move an output by rounding the activations to 8 bits per block
    of 32 (round_blocks8): the rounding's own error through the weights' magnitudes; 0 where the plain-torch
    implementation runs."""
    if not native.int4_linear_available():
        return 0.0
    q, sa = i4.round_blocks8(x)
    moved = (x.reshape(q.shape).double() - q.double() * sa.double().repeat_interleave(i4.DECODE_BLOCK, -1)).abs()
    return float((moved @ weight.double().abs().T).max())


def test_round_blocks8_is_half_a_step_per_block():
    x = torch.randn(3, 96) * torch.logspace(-2, 2, 96)
    x[1, 32:64] = 0.0  # an all-zero block: scale 1, q 0
    q, sa = i4.round_blocks8(x)
    assert q.shape == (3, 96) and sa.shape == (3, 3)
    assert bool((q.abs() <= 127).all()) and torch.equal(q, q.round())
    assert sa[1, 1] == 1 and bool((q[1, 32:64] == 0).all())
    blocks = x.view(3, 3, 32)
    assert torch.equal(sa, torch.where(blocks.abs().amax(-1) > 0, blocks.abs().amax(-1) / 127, torch.ones(3, 3)))
    # each block's largest element is exactly +-127 levels, and every element within half a level
    assert bool((q.view(3, 3, 32).abs().amax(-1)[sa != 1] == 127).all())
    assert bool(((q.view(3, 3, 32) * sa[..., None] - blocks).abs() <= sa[..., None] / 2 * (1 + 1e-6)).all())


def test_layout_low_nibble_even_high_nibble_odd():
    # row 0: q = -8, 7, 0, 1 with scale 2 -> bytes (0 | 15 << 4), (8 | 9 << 4)
    qweight = torch.tensor([[0 | (15 << 4), 8 | (9 << 4)]], dtype=torch.uint8)
    scale = torch.tensor([[2.0]], dtype=torch.bfloat16)
    assert unpack_int4(qweight).tolist() == [[-8, 7, 0, 1]]
    assert dequantize_int4(qweight, scale, 4).tolist() == [[-16.0, 14.0, 0.0, 2.0]]
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert int4_linear(x, qweight, scale, 4).tolist() == [[-16.0 + 28.0 + 8.0]]
    # and the quantizer writes that layout
    q, s = quantize_int4(torch.tensor([[-16.0, 14.0, 0.0, 2.0]]), 4)
    assert torch.equal(q, qweight) and torch.equal(s, scale)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bounds(group_size, dtype):
    weight = _weight(dtype=dtype)
    original = weight.clone()
    q, scale = quantize_int4(weight, group_size)
    assert torch.equal(weight, original)  # never edited
    assert q.dtype == torch.uint8 and q.shape == (48, 128)
    assert scale.dtype == torch.bfloat16 and scale.shape == (48, 256 // group_size)
    w = weight.float()
    deq = dequantize_int4(q, scale, group_size)
    err = (deq - w).abs().reshape(48, -1, group_size)
    amax = w.abs().reshape(48, -1, group_size).amax(-1, keepdim=True)
    # per group, relative to the group's own range: the scale is at most largest |w| / 7 and the clipped
    # side loses at most 2/9 of it (divisor -9: the opposite extreme reaches level 7 of 9)
    assert bool((err <= amax * 0.23 + 1e-12).all())
    # RMS error relative to each row's RMS (Gaussian rows), averaged over rows: measured 0.081 / 0.090 /
    # 0.098 for groups of 32 / 64 / 128 (Q4_0's rounding alone: 0.086 / 0.095 / 0.103)
    rel = float(((deq - w).square().mean(1) / w.square().mean(1)).sqrt().mean())
    assert rel < {32: 0.085, 64: 0.094, 128: 0.103}[group_size], rel
    # the search over divisors is no worse than Q4_0's single divisor
    saved = i4._DIVISORS
    try:
        i4._DIVISORS = (-8.0,)
        q0, s0 = quantize_int4(weight, group_size)
    finally:
        i4._DIVISORS = saved
    assert float((dequantize_int4(q0, s0, group_size) - w).square().sum()) > float((deq - w).square().sum())


def test_zero_groups_and_bad_layouts():
    weight = _weight(n=4, k=64)
    weight[1, :32] = 0
    q, scale = quantize_int4(weight, 32)
    assert float(scale[1, 0]) == 0 and bool(torch.isfinite(scale.float()).all())
    assert bool((dequantize_int4(q, scale, 32)[1, :32] == 0).all())
    with pytest.raises(ValueError, match="multiple"):
        quantize_int4(_weight(n=4, k=48), 32)


def test_quantize_in_blocks(monkeypatch):
    weight = _weight(n=10, k=64)
    full = quantize_int4(weight, 32)
    monkeypatch.setattr(i4, "ROWS_PER_BLOCK", 3)
    part = quantize_int4(weight, 32)
    assert all(torch.equal(a, b) for a, b in zip(full, part))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_shape", [(1, 256), (5, 256), (2, 7, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_linear_against_float64(x_dtype, x_shape, with_bias):
    gen = torch.Generator().manual_seed(1)
    q, scale = quantize_int4(_weight(seed=1), 64)
    x = torch.randn(x_shape, generator=gen).to(x_dtype)
    bias = (torch.randn(48, generator=gen) * 4).to(x_dtype) if with_bias else None
    out = int4_linear(x, q, scale, 64, bias)
    assert out.dtype == x_dtype and out.shape == (*x_shape[:-1], 48)
    weight = dequantize_int4(q, scale, 64, torch.float64)
    ref = x.double() @ weight.T + (bias.double() if with_bias else 0.0)
    err = float((out.double() - ref).abs().max())
    bound = (1e-6 if x_dtype == torch.float32 else 2**-8) * float(ref.abs().max())
    bound += _rounding(x, weight)
    assert err <= bound, (err, bound)
    # the scales applied to the wrong groups are far outside the bound
    wrong = x.double() @ dequantize_int4(q, scale.flip(1), 64, torch.float64).T
    assert float((out.double() - wrong - (bias.double() if with_bias else 0)).abs().max()) > 10 * bound


def test_blockwise_dequantization(monkeypatch):
    """The op dequantizes ROWS_PER_BLOCK rows at a time, never the whole weight, with the same result."""
    q, scale = quantize_int4(_weight(n=50, seed=2), 32)
    x = torch.randn(3, 256)
    whole = int4_linear(x, q, scale, 32)
    seen = []
    original = i4.dequantize_int4

    def spy(qw, s, g, dtype=torch.float32):
        seen.append(qw.shape[0])
        return original(qw, s, g, dtype)

    monkeypatch.setattr(i4, "ROWS_PER_BLOCK", 16)
    monkeypatch.setattr(i4, "dequantize_int4", spy)
    import autodeploy.custom_ops.half_linear as hl

    monkeypatch.setattr(hl, "ROWS_PER_BLOCK", 16)
    out = i4.int4_linear_reference(x, q, scale, 32)
    assert seen == [16, 16, 16, 2]
    # where the native kernel runs, ``whole`` sums in another order (float32 rounding over K = 256 products)
    # of activations rounded to 16 bits (each by at most max|x| / 65534)
    torch.testing.assert_close(out, whole, atol=1e-4 + _rounding(x, dequantize_int4(q, scale, 32)), rtol=1e-4)


def test_bad_inputs_and_fake_shapes():
    q, scale = quantize_int4(_weight(), 32)
    with pytest.raises(ValueError, match="scale"):
        i4.int4_linear_reference(torch.randn(2, 256), q, scale[:, :4], 32)
    with pytest.raises(ValueError, match="qweight"):
        i4.int4_linear_reference(torch.randn(2, 128), q, scale, 32)
    with FakeTensorMode() as mode:
        out = int4_linear(mode.from_tensor(torch.empty(2, 9, 256)), mode.from_tensor(q), mode.from_tensor(scale), 32)
    assert out.shape == (2, 9, 48) and out.dtype == torch.float32


def test_registered_product_with_group_size_static():
    entry = next(p for p in product_ops() if p.op == int4_linear.default)
    assert entry is i4.INT4_LINEAR and not entry.dense
    assert entry.row_args == ("qweight", "scale") and entry.static_args == ("group_size",)


def test_compile_form_decode_row():
    gen = torch.Generator().manual_seed(4)
    q, scale = quantize_int4(_weight(seed=4), 64)
    x, bias = torch.randn(1, 1, 256, generator=gen), torch.randn(48, generator=gen)
    decode = i4.int4_linear_for_compile(decode=True)
    weight = dequantize_int4(q, scale, 64, torch.float64)
    ref = x.double() @ weight.T + bias.double()
    torch.testing.assert_close(decode(x, q, scale, 64, bias).double(), ref,
                               atol=1e-5 * float(ref.abs().max()) + _rounding(x, weight), rtol=0)
    more = torch.randn(1, 3, 256, generator=gen)
    assert torch.equal(decode(more, q, scale, 64, bias), int4_linear(more, q, scale, 64, bias))


@pytest.mark.slow  # compiles with Inductor
def test_compile_form_compiles():
    q, scale = quantize_int4(_weight(seed=5), 32)
    x = torch.randn(1, 1, 256)
    decode = i4.int4_linear_for_compile(decode=True)
    compiled = torch.compile(decode, fullgraph=True)
    torch.testing.assert_close(compiled(x, q, scale, 32), decode(x, q, scale, 32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n, rows", [(48, 8), (37, 8), (5, 16), (16, 16)])  # whole tiles, a tail, one partial tile
def test_tiles_hold_word_j_of_each_row_side_by_side(n, rows):
    q, scale = quantize_int4(_weight(n=n, seed=n), 64)
    words, tile_scale = i4.pack_int4_tiles(q, scale, rows)
    tiles = -(-n // rows)
    assert words.shape == (tiles, 256 // 8, rows) and words.dtype == torch.int32
    assert tile_scale.shape == (tiles, 256 // 64, rows) and tile_scale.dtype == scale.dtype
    as_words = q.view(torch.int32)
    for t, j, r in [(0, 0, 0), (0, 3, 1), (tiles - 1, 31, rows - 1)]:
        row = min(t * rows + r, n - 1)  # rows past N repeat the last
        assert words[t, j, r] == as_words[row, j] and tile_scale[t, j % 4, r] == scale[row, j % 4]
    back, back_scale = i4.unpack_int4_tiles(words, tile_scale, n)
    assert torch.equal(back, q) and torch.equal(back_scale, scale)


def test_packed_reference_is_int4_linear_and_checks_its_inputs():
    q, scale = quantize_int4(_weight(n=37), 32)
    words, tile_scale = i4.pack_int4_tiles(q, scale, 8)
    x, bias = torch.randn(3, 256), torch.randn(37)
    torch.testing.assert_close(i4.int4_packed_linear_reference(x, words, tile_scale, 32, 37, bias),
                               i4.int4_linear_reference(x, q, scale, 32, bias), atol=0, rtol=0)
    with pytest.raises(ValueError, match="out_features"):
        i4.int4_packed_linear_reference(x, words, tile_scale, 32, 48)
    with pytest.raises(ValueError, match="words must be int32"):
        i4.int4_packed_linear_reference(x, words.view(torch.uint8), tile_scale, 32, 37)
    with FakeTensorMode() as mode:
        x_fake, words_fake, scale_fake = map(mode.from_tensor, (torch.empty(2, 9, 256), words, tile_scale))
        out = torch.ops.auto_deploy.int4_packed_linear(x_fake, words_fake, scale_fake, 32, 37)
    assert out.shape == (2, 9, 37)


def test_packed_product_is_registered_as_not_row_major():
    entry = next(p for p in product_ops() if p.op == torch.ops.auto_deploy.int4_packed_linear.default)
    assert entry is i4.INT4_PACKED_LINEAR and not entry.row_major and i4.INT4_LINEAR.row_major
    assert entry.static_args == ("group_size", "out_features")

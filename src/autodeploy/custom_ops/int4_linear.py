"""``auto_deploy::int4_linear``: a linear layer with 4-bit weights and group-wise scales (weight-only).

    int4_linear(x [..., K], qweight uint8 [N, K//2], scale bf16 [N, K//group_size], group_size, bias [N]?)
        -> (x.float() @ W.T + bias.float()).to(x.dtype),  W[n, k] = float(scale[n, k // group_size]) * (nib(n, k) - 8)

The layout: weight element k of row n is in byte ``k // 2`` of row n, the low nibble for even k and the high
nibble for odd k, stored as ``q + 8`` with q in [-8, 7]. One bf16 scale per ``group_size`` consecutive
elements of a row (4.5 bits per weight at group size 32, 4.125 at 128). The products are float32.

:func:`quantize_int4` is the quantizer (llama.cpp's Q4_0 rounding, refined: see its docstring),
:func:`dequantize_int4` its inverse. The plain-torch implementation dequantizes :data:`ROWS_PER_BLOCK`
output rows at a time and multiplies each block (:func:`~autodeploy.custom_ops.half_linear.blockwise_product`),
so no dequantized copy of the whole weight exists per call, on the prompt path too. Native CPU kernels
(decode batches, and prompts up to the build's ``native.gemm_max_rows()``) register as its CPU
implementation (:mod:`autodeploy.custom_ops.native`) and are tested against this one. Their prompt products
are float32 over the dequantized weights, except that their products of up to 16 rows (decode batches,
short prompts) and, on x86 builds, of more rows take llama.cpp's Q4_0 x Q8_0
arithmetic (:func:`int4_decode_reference`): the activations rounded to 8 bits per block of 32
(:func:`round_blocks8`), each block's products summed exactly in integers from the nibbles as bytes
(``vpmaddubsw``, or ``vpdpbusd`` with AVX512-VNNI). On the Intel Xeon of docs/performance.md that made the
125M Llama's 49 decode products 1.2-1.4x faster than with 16-bit activations, and its 128-row prompt products
1.26-1.34x; at 4-16 rows, 1.5-2.5x faster than the float32 arithmetic they had before. Up to 16 rows each row's
result is the same, bit for bit, whatever rows share its call, so a sequence's tokens do not depend on the
batch it is decoded in. The rounding moves each activation by at most half a step of its block, ``max|x| / 254`` of the
block's largest (the 4-bit weights are off by about 8 % of their standard deviation, see ``_DIVISORS``);
what it costs a model is in docs/performance.md ("Issue 18, seventeenth round"). ``quantize_weights``
with ``dtype: int4`` makes these products; linears whose K is not
a multiple of the group size stay as they are.

``auto_deploy::int4_packed_linear`` is the same product over the same weight stored in tiles of R rows
(:func:`pack_int4_tiles`), the layout the x86 builds' kernels read fastest: one vector lane per weight row, so
a block of 32 weights takes one broadcast of its activations and one float multiply-add per R rows
(``native/kernels.cpp``, ``int4_packed_gemm``). ``pack_int4_weights`` (``transform/library/pack_int4.py``) makes
these products where the native kernels run such a build; their sums equal the x86 prompt products' (the
Q4_0 x Q8_0 arithmetic above) bit for bit.

    int4_packed_linear(x [..., K], words int32 [tiles, K//8, R], scale bf16 [tiles, K//group_size, R],
                       group_size, out_features, bias [N]?)
"""

from __future__ import annotations

from typing import Callable

import torch

from ..utils.products import ProductOp, register_product
from . import native
from .half_linear import blockwise_product

#: the scales' dtype (the native kernels read them as bf16)
SCALE_DTYPE = torch.bfloat16
#: the group sizes quantize_weights accepts
GROUP_SIZES = (32, 64, 96, 128)
#: rows quantized / dequantized at a time
ROWS_PER_BLOCK = 1024
#: candidate divisors of a group's signed largest value: Q4_0 maps it to -8; smaller ones clip less of the
#: group's other side, larger ones clip the largest value for finer steps; the quantizer keeps, per group, the
#: one of least squared error (on Gaussian weights: RMS error 0.081 of the weights' std at group size 32,
#: against Q4_0's 0.086; 0.097 against 0.103 at 128)
_DIVISORS = tuple(-7.0 - 0.25 * i for i in range(9))


def _check_layout(k: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 2 or k % group_size:
        raise ValueError(f"int4 weights need K ({k}) a multiple of an even group_size ({group_size})")


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (any float dtype) -> (qweight uint8 [N, K//2], scale bf16 [N, K//group_size]).

    Group-wise symmetric: for each group of ``group_size`` elements of a row with signed largest value m,
    the scale is ``m / d`` rounded to bf16 for each d of :data:`_DIVISORS` (-7 to -9; d = -8 is llama.cpp's
    Q4_0: m maps to -8, using all 16 levels), the values are rounded to the nearest level ``clamp(round(w / s), -8,
    7)``, and the candidate of least squared error is kept. A group of zeros gets scale 0. The input is
    never edited; the float32 temporaries are :data:`ROWS_PER_BLOCK` rows at a time."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int4 takes a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_layout(k, group_size)
    weight = weight.detach()
    groups = k // group_size
    qweight = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(n, groups, dtype=SCALE_DTYPE, device=weight.device)
    for start in range(0, n, ROWS_PER_BLOCK):
        w = weight[start : start + ROWS_PER_BLOCK].to(torch.float32).reshape(-1, groups, group_size)
        index = w.abs().argmax(dim=-1, keepdim=True)
        signed_max = w.gather(-1, index)  # [rows, groups, 1]
        best_q = best_s = best_err = None
        for divisor in _DIVISORS:
            s = (signed_max / divisor).to(SCALE_DTYPE).float()
            inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
            q = torch.round(w * inv).clamp_(-8, 7)
            err = (q * s - w).square_().sum(-1, keepdim=True)
            if best_err is None:
                best_q, best_s, best_err = q, s, err
            else:
                better = err < best_err
                best_q = torch.where(better, q, best_q)
                best_s = torch.where(better, s, best_s)
                best_err = torch.minimum(err, best_err)
        nibbles = (best_q + 8).to(torch.uint8).reshape(-1, k)
        qweight[start : start + ROWS_PER_BLOCK] = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        scale[start : start + ROWS_PER_BLOCK] = best_s.reshape(-1, groups).to(SCALE_DTYPE)
    return qweight, scale


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight uint8 [N, K//2] -> the signed values q in [-8, 7] as int8 [N, K]."""
    low = (qweight & 15).to(torch.int8)
    high = (qweight >> 4).to(torch.int8)
    return torch.stack([low, high], dim=-1).reshape(qweight.shape[0], -1) - 8


def dequantize_int4(qweight: torch.Tensor, scale: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] in ``dtype`` that ``(qweight, scale)`` stands for: ``scale[n, k // group_size] *
    (nibble - 8)``, computed in float32."""
    q = unpack_int4(qweight).float()
    n, k = q.shape
    _check_layout(k, group_size)
    w = q.reshape(n, k // group_size, group_size) * scale.float()[:, :, None]
    return w.reshape(n, k).to(dtype)


_LIB = torch.library.Library("auto_deploy", "FRAGMENT")
_LIB.define("int4_linear(Tensor x, Tensor qweight, Tensor scale, int group_size, Tensor? bias=None) -> Tensor")


def int4_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group_size: int,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::int4_linear`` (see the module docstring)."""
    if qweight.dtype != torch.uint8 or qweight.shape[1] * 2 != x.shape[-1]:
        raise ValueError(f"int4_linear: qweight must be uint8 [N, K/2] for K={x.shape[-1]}, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    if scale.shape != (qweight.shape[0], x.shape[-1] // group_size):
        raise ValueError(f"int4_linear: scale must be [N, K/group_size] = [{qweight.shape[0]}, "
                         f"{x.shape[-1] // group_size}], got {tuple(scale.shape)}")
    return blockwise_product(
        x, qweight.shape[0],
        lambda start, end: dequantize_int4(qweight[start:end], scale[start:end], group_size), bias)


_LIB.impl("int4_linear", int4_linear_reference, "CompositeExplicitAutograd")

#: the native decode products round the activations to 8 bits per block of this many and sum each block's
#: products exactly in integers (group sizes are multiples of it)
DECODE_BLOCK = 32
#: the 8-bit activations' levels: q in [-127, 127]
_Q8_LEVELS = 127


def round_blocks8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The native 4-bit products' activation rounding: each block of :data:`DECODE_BLOCK` consecutive elements
    of each row of ``x [..., K]`` (as float32 rows [M, K]) to ``q = round(x * (1 / sa))`` (half to even),
    ``sa = max|x| / 127`` of the block (1 for an all-zero block). Returns (q [M, K] float32 holding integers,
    sa [M, K / DECODE_BLOCK])."""
    rows = x.reshape(-1, x.shape[-1]).float()
    blocks = rows.view(rows.shape[0], -1, DECODE_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    sa = torch.where(amax > 0, amax / _Q8_LEVELS, torch.ones_like(amax))
    q = torch.round(blocks * (1.0 / sa)).clamp_(-_Q8_LEVELS, _Q8_LEVELS)
    return q.view_as(rows), sa.squeeze(-1)


def int4_decode_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """The native kernels' arithmetic for up to 16 rows (and on x86 builds for more), in float64 (their
    float32 sums differ from it by rounding only): llama.cpp's Q4_0 x Q8_0. Each row of x rounded to 8 bits
    per block of :data:`DECODE_BLOCK` (``q``, ``sa``: :func:`round_blocks8`), the dot product of q with the
    4-bit values ``nibble - 8`` exact per block, each block scaled by its own ``sa`` and its group's scale:
    ``y = sum_b sa[b] * scale[b] * dot_b`` -> float32."""
    n, k = qweight.shape[0], x.shape[-1]
    _check_layout(k, group_size)
    if group_size % DECODE_BLOCK:
        raise ValueError(f"int4_decode_reference: group_size ({group_size}) must be a multiple of {DECODE_BLOCK}")
    q, sa = round_blocks8(x)
    blocks = k // DECODE_BLOCK
    dots = torch.einsum("mbk,nbk->mnb", q.double().view(-1, blocks, DECODE_BLOCK),
                        unpack_int4(qweight).double().view(n, blocks, DECODE_BLOCK))
    block_scale = scale.double().repeat_interleave(group_size // DECODE_BLOCK, dim=1)
    y = (dots * block_scale[None] * sa.double()[:, None, :]).sum(-1)
    return y.float().reshape(*x.shape[:-1], n)


_LIB.define("int4_packed_linear(Tensor x, Tensor words, Tensor scale, int group_size, int out_features, "
            "Tensor? bias=None) -> Tensor")


def pack_int4_tiles(qweight: torch.Tensor, scale: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight uint8 [N, K//2], scale [N, groups]) -> tiles of ``rows`` weight rows: (words int32 [tiles, K//8,
    rows], scale [tiles, groups, rows]). Word j of a row is its bytes 4j..4j+3 (weights 8j..8j+7); a tile holds
    word j of each of its rows side by side. Rows past N repeat the last row."""
    n, half_k = qweight.shape
    if half_k % 4 or rows <= 0:
        raise ValueError(f"pack_int4_tiles: K ({2 * half_k}) must be a multiple of 8 and rows ({rows}) positive")
    tiles = -(-n // rows)
    index = torch.arange(tiles * rows).clamp_(max=n - 1)
    words = qweight.contiguous().view(torch.int32)[index].view(tiles, rows, half_k // 4)
    return words.transpose(1, 2).contiguous(), scale[index].view(tiles, rows, -1).transpose(1, 2).contiguous()


def unpack_int4_tiles(words: torch.Tensor, scale: torch.Tensor, out_features: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_int4_tiles`'s inverse: (qweight uint8 [out_features, K//2], scale [out_features, groups])."""
    tiles, _, rows = words.shape
    qweight = words.transpose(1, 2).contiguous().view(torch.uint8).reshape(tiles * rows, -1)
    return qweight[:out_features], scale.transpose(1, 2).reshape(tiles * rows, -1)[:out_features]


def int4_packed_linear_reference(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, group_size: int,
                                 out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::int4_packed_linear``: ``int4_linear`` of the unpacked
    weight."""
    if words.dtype != torch.int32 or words.dim() != 3 or scale.dim() != 3 or scale.shape[0::2] != words.shape[0::2]:
        raise ValueError(f"int4_packed_linear: words must be int32 [tiles, K/8, R] and scale [tiles, groups, R], "
                         f"got {words.dtype} {tuple(words.shape)} and {tuple(scale.shape)}")
    tiles, _, rows = words.shape
    if not (tiles - 1) * rows < out_features <= tiles * rows:
        raise ValueError(f"int4_packed_linear: out_features ({out_features}) does not fit {tiles} tiles of {rows} rows")
    qweight, row_scale = unpack_int4_tiles(words, scale, out_features)
    return int4_linear_reference(x, qweight, row_scale, group_size, bias)


_LIB.impl("int4_packed_linear", int4_packed_linear_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::int4_packed_linear", lib=_LIB)
def _int4_packed_linear_fake(x, words, scale, group_size, out_features, bias=None):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.register_fake("auto_deploy::int4_linear", lib=_LIB)
def _int4_linear_fake(x, qweight, scale, group_size, bias=None):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


#: decode products of at most this many rows read as a dequantize-multiply-and-sum under torch.compile
GEMV_MAX_ROWS = 1


def int4_linear_for_compile(decode: bool) -> Callable:
    """``int4_linear`` as a graph compiled with ``torch.compile`` reads it: for one decode row, the unpacking,
    the scaling and a float32 multiply-and-sum over K in plain torch, which Inductor fuses into one loop over
    the packed weight; otherwise the op (it dequantizes block by block, never the whole weight). Where the
    native kernels run, decode keeps the op too: its CPU implementation is the native kernel (decided here,
    outside the trace)."""
    inline = decode and not native.int4_linear_available()

    def form(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None):
        rows = x.numel() // x.shape[-1]
        if inline and isinstance(rows, int) and rows <= GEMV_MAX_ROWS:
            n, k = qweight.shape[0], x.shape[-1]
            x_pairs = x.float().reshape(*x.shape[:-1], 1, k // group_size, group_size // 2, 2)
            low = (qweight & 15).to(torch.float32) - 8
            high = (qweight >> 4).to(torch.float32) - 8
            shape = (n, k // group_size, group_size // 2)
            partial = (x_pairs[..., 0] * low.reshape(shape) + x_pairs[..., 1] * high.reshape(shape)).sum(-1)
            out = (partial * scale.float()).sum(-1)
            if bias is not None:
                out = out + bias.float()
            return out.to(x.dtype)
        return torch.ops.auto_deploy.int4_linear(x, qweight, scale, group_size, bias)

    return form


INT4_LINEAR = register_product(ProductOp(torch.ops.auto_deploy.int4_linear.default, input_arg="x",
                                         row_args=("qweight", "scale"), static_args=("group_size",),
                                         compile_form=int4_linear_for_compile))

#: tile-packed: fusion and sharding, which concatenate and split rows, leave these alone (the packing runs after them)
INT4_PACKED_LINEAR = register_product(ProductOp(
    torch.ops.auto_deploy.int4_packed_linear.default, input_arg="x", row_args=("words", "scale"),
    static_args=("group_size", "out_features"), row_major=False,
    compile_form=lambda decode: torch.ops.auto_deploy.int4_packed_linear))

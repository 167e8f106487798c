"""``auto_deploy::torch_int8_linear``: a linear layer with int8 weights (weight-only quantization).

    torch_int8_linear(x, weight_int8 [N, K], scale [N], bias=None) -> x @ (weight_int8 * scale[:, None]).T + bias

Weights are quantized per output channel, symmetric (:func:`quantize_per_channel_int8`): 4x fewer weight
bytes to read per token than fp32, which is what bounds decode speed on CPU. The weights are never
dequantized as a whole; the product takes one of three paths by the number of rows:

- decode (at most :data:`NATIVE_MAX_ROWS` rows of float32, where the native kernel runs):
  ``auto_deploy::int8_gemv``, whose native kernel (:mod:`autodeploy.custom_ops.native`) streams the
  int8 weights at memory speed with the activations rounded to 16 bits per row;
- otherwise, below :data:`SPLIT_MIN_ROWS` rows: torch's int8 weight-only kernel
  (``aten._weight_int8pack_mm``), whose activations and output are bfloat16 with fp32 accumulation;
- more rows (prompts) on a CPU with VNNI: ``torch._int_mm`` (oneDNN's int8 GEMM) over the activations
  rounded to 15 bits per row and split into two int8 halves, so one int8 product of twice the rows gives the
  exact product of the 15-bit activations (``auto_deploy::int8_split_mm``, :func:`_split_activation_mm`; its
  native CPU implementation rounds and splits the rows in one pass and rescales the products in another,
  where plain torch takes a dozen passes: the 125M Llama's 128-token prompt spent 50 ms in its int8 products
  against 128 ms, docs/performance.md; on CPUs with AMX it runs the int8 products on AMX instead of
  ``torch._int_mm``, the same integers, ``native/amx.h``). Without VNNI torch's int8 GEMM has no fast path
  (a 128-token prompt of the 125M model took 10.3 s on an AVX2 machine, HF 0.35 s), so there the x86 native
  builds take prompts through ``auto_deploy::int8_gemv``, whose kernel multiplies pairs of 16-bit
  activations with ``vpmaddwd`` for many rows (its exact arithmetic, 1.2-1.7x the float32 product at 128
  rows); elsewhere (ARM, other devices, no native kernels) prompts take a float32 product over the
  dequantized weights (``auto_deploy::int8_mm``: on CPU a native kernel that dequantizes each tile of weight
  rows once, elsewhere a block of rows at a time, :func:`_dequantized_mm`).

``auto_deploy::int8_gemv(x, weight, scale) -> float32`` has a plain-torch implementation with the kernel's
exact arithmetic (:func:`int8_gemv_reference`: the same 16-bit activation rounding, an exact integer dot
product, the same float32 rescaling), so the kernel and the reference agree bit for bit. Without the
kernel, decode products take torch's int8 kernel instead (faster than the reference), whose bfloat16
activations differ from the kernel's by at most :data:`INT8_GEMV_VS_TORCH_RTOL` of the output's scale.

The op casts back to the activation dtype, so the graph around it keeps it (norms, attention and
residuals stay in fp32). The scales are rounded to bfloat16 before quantizing, so the bfloat16 kernel
uses them exactly.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..utils.products import ProductOp, register_product
from . import native
from .half_linear import blockwise_product

_KERNEL_DTYPE = torch.bfloat16
_ROWS_PER_CHUNK = 1024


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> (int8 [N, K], bfloat16 scale [N]) with ``weight ~= q * scale[:, None]``."""
    weight = weight.detach()
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=_KERNEL_DTYPE, device=weight.device)
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):  # chunks: fp32 temporaries stay small
        rows = weight[start : start + _ROWS_PER_CHUNK].to(torch.float32, copy=True)  # never edit the original
        s = (rows.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(_KERNEL_DTYPE)
        q[start : start + _ROWS_PER_CHUNK] = rows.div_(s.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        scale[start : start + _ROWS_PER_CHUNK] = s
    return q, scale


#: up to this many rows (decode batches) the native kernel takes the product where it is available
NATIVE_MAX_ROWS = 16
#: without it, from this many rows on the split-activation int8 GEMM beats torch's int8 kernel on CPU
SPLIT_MIN_ROWS = 8
#: activations are rounded to this many magnitude steps per row on the prompt path (15 bits), so that
#: both halves of the split fit int8: hi in [-64, 64], lo in [-128, 127]
_SPLIT_LEVELS = 16383


def _split_activation_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (weight * scale).T`` in float32 with one int8 GEMM: each row of x is rounded to
    15-bit integers ``x15 = 256 * hi + lo`` (relative error <= 2^-15 of the row's largest value) and
    ``[hi; lo] @ weight.T`` is computed exactly in int32. The plain-torch implementation of
    ``auto_deploy::int8_split_mm``."""
    leading = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1]).float()
    row_scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / _SPLIT_LEVELS
    # int32, not int16: Inductor vectorizes the int32 arithmetic, not the int16 one
    x15 = torch.round(x / row_scale).clamp_(-_SPLIT_LEVELS, _SPLIT_LEVELS).to(torch.int32)
    lo = ((x15 + 128) & 255) - 128
    hi = (x15 - lo) >> 8
    rows = x.shape[0]
    products = torch._int_mm(torch.cat([hi, lo]).to(torch.int8), weight.t())  # weight read once for both
    out = (products[:rows].float() * 256 + products[rows:].float()) * (row_scale * scale.float())
    return out.reshape(*leading, weight.shape[0])


# read once: torch.compile does not trace the queries. torch's int8 GEMM takes oneDNN's path only where the
# CPU has AVX-512 VNNI; ATEN_CPU_CAPABILITY=avx2 (what an AVX2-only machine runs) takes the other path too,
# since oneDNN would still find VNNI there and time a path an AVX2 machine does not have
_HAS_VNNI = torch.cpu._is_vnni_supported() and torch.backends.cpu.get_cpu_capability() == "AVX512"


def int8_gemm_is_fast() -> bool:
    """Whether torch's int8 GEMM has its fast path on this CPU (VNNI); prompts use it only then."""
    return _HAS_VNNI


def _dequantized_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (weight * scale).T`` in float32 over the weight dequantized a block of rows at a time: the
    plain-torch implementation of ``auto_deploy::int8_mm``."""
    return blockwise_product(x.float(), weight.shape[0],
                             lambda start, end: weight[start:end].float() * scale[start:end, None].float())


def _prompt_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, has_native: bool) -> torch.Tensor:
    """The product of many rows (prompts, large decode batches): see the module docstring. The split GEMM is
    its op where the native kernels run (``has_native``, decided by the caller outside any trace: their
    passes around the GEMM), else plain torch (which torch.compile fuses). Without VNNI, the x86 builds'
    pair products (``int8_gemv``), else the dequantized float32 product."""
    if x.device.type == "cpu" and int8_gemm_is_fast():
        if has_native:
            return torch.ops.auto_deploy.int8_split_mm(x, weight, scale)
        return _split_activation_mm(x, weight, scale)
    if has_native and native.pair_products() and native.int8_gemv_takes(x, weight, scale):
        return torch.ops.auto_deploy.int8_gemv(x, weight, scale)
    return torch.ops.auto_deploy.int8_mm(x, weight, scale)


_OPS = torch.library.Library("auto_deploy", "FRAGMENT")
_OPS.define("int8_gemv(Tensor x, Tensor weight, Tensor scale) -> Tensor")

#: the levels of the 16-bit activation rounding of ``int8_gemv``
_GEMV_LEVELS = 32767
#: without the kernel, decode products (torch's int8 kernel, bfloat16 activations) stay within this of the
#: kernel's, relative to the largest output magnitude (bfloat16 keeps 8 bits: 2^-8 per product term)
INT8_GEMV_VS_TORCH_RTOL = 1e-2


def round_rows16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The native decode kernels' 16-bit activation rounding: each row of ``x [..., K]`` (as float32 rows
    [M, K]) to ``q = round(x * (1 / sx))`` (half to even), ``sx = max|x| / 32767`` (1 for an all-zero row).
    Returns (q [M, K] float32 holding integers, sx [M, 1])."""
    rows = x.reshape(-1, x.shape[-1]).float()
    amax = rows.abs().amax(dim=-1, keepdim=True)
    sx = torch.where(amax > 0, amax / _GEMV_LEVELS, torch.ones_like(amax))
    return torch.round(rows * (1.0 / sx)).clamp_(-_GEMV_LEVELS, _GEMV_LEVELS), sx


def int8_gemv_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (weight [N, K] * scale[:, None]).T`` in float32 with the native kernel's arithmetic:
    each row of x rounded to 16 bits (:func:`round_rows16`), the dot products of q with the int8 weights
    exact (integers below 2^53 in float64), then ``float32(dot) * sx * scale``."""
    q, sx = round_rows16(x)
    dot = (q.double() @ weight.double().t()).float()
    return (dot * sx * scale.float()).reshape(*x.shape[:-1], weight.shape[0])


_OPS.impl("int8_gemv", int8_gemv_reference, "CompositeExplicitAutograd")

# ``auto_deploy::int8_mm(x, weight, scale) -> float32``: the float32 product over the dequantized weights, for
# prompts where torch's int8 GEMM has no fast path; the native kernel (:mod:`autodeploy.custom_ops.native`)
# registers as its CPU implementation, which dequantizes each tile of weights once instead of a copy per block
_OPS.define("int8_mm(Tensor x, Tensor weight, Tensor scale) -> Tensor")
_OPS.impl("int8_mm", _dequantized_mm, "CompositeExplicitAutograd")


# ``auto_deploy::int8_split_mm(x, weight, scale) -> float32``: :func:`_split_activation_mm` as an op, whose native
# CPU implementation (:mod:`autodeploy.custom_ops.native`) runs the rounding and split of the rows and the
# rescaling of the products as two of its kernels around the same int8 GEMM, bit for bit
_OPS.define("int8_split_mm(Tensor x, Tensor weight, Tensor scale) -> Tensor")
_OPS.impl("int8_split_mm", _split_activation_mm, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::int8_split_mm", lib=_OPS)
def _int8_split_mm_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


@torch.library.register_fake("auto_deploy::int8_mm", lib=_OPS)
def _int8_mm_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


@torch.library.register_fake("auto_deploy::int8_gemv", lib=_OPS)
def _int8_gemv_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


def _int8_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (weight * scale).T`` in float32 by the path for its number of rows (see the module
    docstring)."""
    num_rows = x.numel() // x.shape[-1]
    if num_rows <= NATIVE_MAX_ROWS and native.int8_gemv_available() and native.int8_gemv_takes(x, weight, scale):
        return torch.ops.auto_deploy.int8_gemv(x, weight, scale)
    rows = x.reshape(num_rows, x.shape[-1])
    if num_rows < SPLIT_MIN_ROWS:
        out = torch.ops.aten._weight_int8pack_mm(rows.to(_KERNEL_DTYPE), weight, scale.to(_KERNEL_DTYPE)).float()
    else:
        out = _prompt_mm(rows, weight, scale, native.int8_gemv_available())
    return out.reshape(*x.shape[:-1], weight.shape[0])


def int8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The implementation of ``auto_deploy::torch_int8_linear``."""
    out = _int8_product(x, weight, scale).to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


torch_int8_linear = torch.library.custom_op("auto_deploy::torch_int8_linear", int8_linear_reference, mutates_args=())


@torch_int8_linear.register_fake
def _torch_int8_linear_fake(x, weight, scale, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _decode_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``int8_gemv`` for decode-sized inputs, the prompt product for more rows (a large decode batch).
    No input checks: the compiled graph calls it only where the native kernel takes its inputs
    (:func:`native.int8_gemv_takes`, checked when the graph is traced: dtypes, devices and K are fixed)."""
    if x.numel() <= NATIVE_MAX_ROWS * x.shape[-1]:
        return torch.ops.auto_deploy.int8_gemv(x, weight, scale)
    return _prompt_mm(x.reshape(-1, x.shape[-1]), weight, scale,
                      native.int8_gemv_available()).reshape(*x.shape[:-1], weight.shape[0])


# ``auto_deploy::int8_product(x, weight, scale) -> float32``: the product of compiled decode graphs that
# serve several batch sizes, which call it between Inductor's kernels. Registered through the low-level
# library API, which costs less per call than torch.library.custom_op. It picks its path at run time, so
# such a graph has no guard on the batch size.
_OPS.define("int8_product(Tensor x, Tensor weight, Tensor scale) -> Tensor")
_OPS.impl("int8_product", _decode_product, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::int8_product", lib=_OPS)
def _int8_product_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


#: without the native kernel, decode products with at most this many rows take the multiply-and-sum
#: form under torch.compile
GEMV_MAX_ROWS = 1


def int8_linear_for_compile(decode: bool) -> Callable:
    """``torch_int8_linear`` as a graph compiled with ``torch.compile`` should read it: a form for
    ``compile_model``'s ``COMPILE_FORMS``, for the decode graph (``decode``) or the general (prompt)
    graph. It is made when the graph is prepared, so the native kernel's availability is decided outside
    the trace, and it branches on nothing that varies between prompts (no guards, no recompiles).

    - Decode, where the native kernel takes the product: its operator ``auto_deploy::int8_gemv`` in a
      graph for one batch size (batch 1), else ``auto_deploy::int8_product`` (the native kernel, or for
      more than :data:`NATIVE_MAX_ROWS` rows the split GEMM, chosen at run time); both cheaper to call
      than the op. The bias add and the cast are left to Inductor.
    - Decode of one row otherwise: a multiply-and-sum over K in fp32, which Inductor turns into one fused
      loop reading each int8 weight once, with the activation's producer (e.g. the RMSNorm) fused in.
      (Inductor's loop order for that form degrades quickly with more rows, so larger decode batches keep
      the op.)
    - Prompts on CPU: the split-activation int8 GEMM (with VNNI): its op where the native kernels run, else in
      plain torch, so Inductor fuses the activation rounding into one loop and the rescaling of the products
      into another; without VNNI the x86 builds' pair products (``int8_gemv``), else the dequantized float32
      product."""
    has_native = native.int8_gemv_available()

    def form(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        rows = x.numel() // x.shape[-1]
        if decode and has_native and native.int8_gemv_takes(x, weight, scale):
            # a graph for one batch size knows its rows (an int): the kernel's operator directly
            static = isinstance(rows, int) and rows <= NATIVE_MAX_ROWS
            out = (torch.ops.auto_deploy.int8_gemv if static else torch.ops.auto_deploy.int8_product)(x, weight, scale)
        elif decode and rows <= GEMV_MAX_ROWS:
            out = (x.float().unsqueeze(-2) * weight.float()).sum(-1) * scale.float()
        elif not decode and x.device.type == "cpu":
            out = _prompt_mm(x.reshape(-1, x.shape[-1]), weight, scale, has_native).reshape(*x.shape[:-1], -1)
        else:
            return torch.ops.auto_deploy.torch_int8_linear(x, weight, scale, bias)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)

    return form


INT8_LINEAR = register_product(ProductOp(torch.ops.auto_deploy.torch_int8_linear.default, input_arg="x",
                                         row_args=("weight", "scale"), compile_form=int8_linear_for_compile))

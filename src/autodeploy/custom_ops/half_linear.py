"""``auto_deploy::half_linear``: a linear layer with 16-bit (bfloat16 or float16) weights, float32 arithmetic;
``auto_deploy::half_packed_linear``: the same product over the weight packed in panels.

    half_linear(x [..., K], weight [N, K] bf16|fp16, bias [N]?)
        -> (x.float() @ weight.float().T + bias.float()).to(x.dtype)
    half_packed_linear(x [..., K], panels [P, K, 16] bf16|fp16, out_features N, bias [N]?) -> the same product

Half the weight bytes of float32 per token (what bounds decode speed on CPU), the products accumulated in
float32. Both 16-bit formats convert to float32 exactly, so the result is the float32 product over the
weight's exact values: against an fp32 model whose weights were rounded to bf16, it differs by float32
summation order only. The activations are not rounded to bfloat16 (unlike torch's bf16 GEMM), except where
prompts run on AMX: there each activation is the sum of two bfloat16 halves, 16 significant bits (an error of
at most 2^-17 of it, against the weights' own 2^-9; ``native.amx_products()``, ``native/amx.h``).

The plain-torch implementation converts the weight to float32 :data:`ROWS_PER_BLOCK` output rows at a time and
multiplies each block, so no float32 copy of the whole weight exists per call (a block's is 1024 x K x 4
bytes). Native CPU kernels (decode batches, prompts up to the build's ``native.gemm_max_rows()``, and bf16
prompts of more than 64 rows on AMX) register as its CPU implementation (:mod:`autodeploy.custom_ops.native`)
and are tested against this one. ``quantize_weights`` with ``dtype: bf16`` / ``fp16`` makes these products
(``transform/library/quantize.py``); a bf16 checkpoint loaded into a float32 graph keeps its linear weights in
bf16 through it (``load_weights``), with no float32 copy of them.

``half_packed_linear`` takes the weight in the panels of ``f32_packed_linear`` (16 rows k-major, in the weight's
own dtype; the ``pack_half_weights`` transform packs them where the build reads them, ``native.half_pack_width()``):
its native kernel widens each panel row to float32 in registers and runs ``f32_packed_linear``'s passes, for every
row count, each output summed over k in order (a row's result does not depend on the rows beside it; one row
alone takes two chains of sums).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..utils.products import ProductOp, register_product
from . import native
from .linear import check_panels, unpack_f32_panels

#: the weight is converted to float32 this many output rows at a time
ROWS_PER_BLOCK = 1024
#: the 16-bit weight dtypes the op takes
HALF_DTYPES = (torch.bfloat16, torch.float16)

_LIB = torch.library.Library("auto_deploy", "FRAGMENT")
_LIB.define("half_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_LIB.define("half_packed_linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None) -> Tensor")


def blockwise_product(x: torch.Tensor, num_out: int, block_weight: Callable[[int, int], torch.Tensor],
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in float32, in x's dtype, where ``block_weight(start, end)`` gives rows
    ``start:end`` of the float32 weight W [num_out, K]: a block of :data:`ROWS_PER_BLOCK` rows at a time."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if num_out <= ROWS_PER_BLOCK:
        out = rows @ block_weight(0, num_out).t()
    else:
        out = rows.new_empty(rows.shape[0], num_out)
        for start in range(0, num_out, ROWS_PER_BLOCK):
            end = min(start + ROWS_PER_BLOCK, num_out)
            out[:, start:end] = rows @ block_weight(start, end).t()
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], num_out).to(x.dtype)


def half_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::half_linear`` (see the module docstring)."""
    if weight.dtype not in HALF_DTYPES:
        raise ValueError(f"half_linear takes bfloat16 or float16 weights, got {weight.dtype}")
    return blockwise_product(x, weight.shape[0], lambda start, end: weight[start:end].float(), bias)


_LIB.impl("half_linear", half_linear_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::half_linear", lib=_LIB)
def _half_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


#: decode products of at most this many rows read as a multiply-and-sum under torch.compile
GEMV_MAX_ROWS = 1


def half_linear_for_compile(decode: bool) -> Callable:
    """``half_linear`` as a graph compiled with ``torch.compile`` reads it: for one decode row, a float32
    multiply-and-sum over K, which Inductor turns into one loop reading each 16-bit weight once (with the
    activation's producer fused in); otherwise the op (a whole-weight conversion that Inductor would
    materialize per call is what the op avoids). Where the native kernels run, decode keeps the op too: its
    CPU implementation is the native kernel (decided here, outside the trace)."""
    inline = decode and not native.half_linear_available()

    def form(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        rows = x.numel() // x.shape[-1]
        if inline and isinstance(rows, int) and rows <= GEMV_MAX_ROWS:
            out = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
            if bias is not None:
                out = out + bias.float()
            return out.to(x.dtype)
        return torch.ops.auto_deploy.half_linear(x, weight, bias)

    return form


# dense: the weight is a plain floating-point [N, K] matrix, which quantize_weights may re-quantize (a bf16
# checkpoint's weights kept as they are by load_weights, then int8 or int4)
HALF_LINEAR = register_product(ProductOp(torch.ops.auto_deploy.half_linear.default, input_arg="x",
                                         row_args=("weight",), dense=True, compile_form=half_linear_for_compile))


def half_packed_linear_reference(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::half_packed_linear``: ``half_linear`` of the weight
    unpacked from its panels (:func:`~autodeploy.custom_ops.linear.pack_f32_panels` keeps a 16-bit weight's
    dtype)."""
    if panels.dtype not in HALF_DTYPES:
        raise ValueError(f"half_packed_linear: panels must be bfloat16 or float16, got {panels.dtype}")
    check_panels("half_packed_linear", panels, out_features)
    return half_linear_reference(x, unpack_f32_panels(panels, out_features), bias)


_LIB.impl("half_packed_linear", half_packed_linear_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::half_packed_linear", lib=_LIB)
def _half_packed_linear_fake(x, panels, out_features, bias=None):
    return x.new_empty(*x.shape[:-1], out_features)


#: panel-packed (``pack_half_weights``): fusion and sharding, which concatenate and split rows, leave these alone
#: (the packing runs after them); every graph calls the operator (the prompts' product too)
HALF_PACKED_LINEAR = register_product(ProductOp(
    torch.ops.auto_deploy.half_packed_linear.default, input_arg="x", row_args=("panels",),
    static_args=("out_features",), row_major=False,
    compile_form=lambda decode: torch.ops.auto_deploy.half_packed_linear.default))

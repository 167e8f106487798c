"""Float32 linear products: ``aten.linear`` as a product op, ``auto_deploy::f32_linear`` and
``auto_deploy::f32_packed_linear``.

    f32_linear(x [..., K], weight [N, K], bias [N]?) -> F.linear(x, weight, bias)
    f32_packed_linear(x [..., K], panels [P, K, 16], out_features N, bias [N]?) -> the same product

``f32_linear`` is ``F.linear`` with a native kernel: where the kernel builds and runs
(:func:`autodeploy.custom_ops.native.f32_linear_available`), up to
:func:`~autodeploy.custom_ops.native.f32_max_rows` rows (decode batches) are multiplied by a kernel that
streams the weight in its own [N, K] layout (``native/kernels.cpp``), and more rows (prompts) by torch's
fastest float32 GEMM: oneDNN's linear on x86, torch's linear elsewhere. Its float32 sums are ordered
differently from torch's GEMM, so logits differ from ``F.linear``'s by float32 rounding only. Everywhere else
the op is ``F.linear``.

``f32_packed_linear`` takes the weight packed in panels of 16 rows (:func:`pack_f32_panels`, by the
``pack_f32_weights`` transform): weight k of a panel's rows side by side, the layout whose native kernel keeps
each output in a vector lane and broadcasts the activations (``native/kernels.cpp``, ``f32_packed_gemm``), for
every row count. Each output is summed over k in order, so a row's result is the same in a decode batch and in a
prompt. Without the native kernels it is ``F.linear`` of the unpacked weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils.products import ProductOp, register_product

_LIB = torch.library.Library("auto_deploy", "FRAGMENT")
_LIB.define("f32_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_LIB.define("f32_packed_linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None) -> Tensor")

#: weight rows per panel of f32_packed_linear's layout
PANEL_ROWS = 16


def f32_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::f32_linear``."""
    return F.linear(x, weight, bias)


_LIB.impl("f32_linear", f32_linear_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::f32_linear", lib=_LIB)
def _f32_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


LINEAR = register_product(ProductOp(torch.ops.aten.linear.default, input_arg="input", row_args=("weight",),
                                    dense=True))
# the decode graph calls the operator (its native kernel); the general graph reads it as a plain linear, so
# Inductor plans prompt GEMMs as for any linear
F32_LINEAR = register_product(ProductOp(
    torch.ops.auto_deploy.f32_linear.default, input_arg="x", row_args=("weight",), dense=True,
    compile_form=lambda decode: torch.ops.auto_deploy.f32_linear.default if decode else F.linear,
))


def pack_f32_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> panels [ceil(N / 16), K, 16]: panel p holds rows 16p..16p+15 k-major (weight k of each row
    side by side); rows past N are zero."""
    if weight.dim() != 2:
        raise ValueError(f"pack_f32_panels: the weight must be [N, K], got {tuple(weight.shape)}")
    n, k = weight.shape
    panels = -(-n // PANEL_ROWS)
    padded = weight.new_zeros(panels * PANEL_ROWS, k)
    padded[:n] = weight
    return padded.view(panels, PANEL_ROWS, k).transpose(1, 2).contiguous()


def unpack_f32_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """:func:`pack_f32_panels`' inverse: the weight [out_features, K] (a copy)."""
    count, k, rows = panels.shape
    return panels.transpose(1, 2).reshape(count * rows, k)[:out_features]


def check_panels(op: str, panels: torch.Tensor, out_features: int) -> None:
    """Raise ValueError, naming ``op``, unless ``panels`` is [P, K, 16] holding ``out_features`` rows."""
    if panels.dim() != 3 or panels.shape[2] != PANEL_ROWS:
        raise ValueError(f"{op}: panels must be [P, K, {PANEL_ROWS}], got {tuple(panels.shape)}")
    if not (panels.shape[0] - 1) * PANEL_ROWS < out_features <= panels.shape[0] * PANEL_ROWS:
        raise ValueError(f"{op}: out_features ({out_features}) does not fit {panels.shape[0]} panels of "
                         f"{PANEL_ROWS} rows")


def f32_packed_linear_reference(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::f32_packed_linear``: ``F.linear`` of the unpacked weight."""
    check_panels("f32_packed_linear", panels, out_features)
    return F.linear(x, unpack_f32_panels(panels, out_features), bias)


_LIB.impl("f32_packed_linear", f32_packed_linear_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("auto_deploy::f32_packed_linear", lib=_LIB)
def _f32_packed_linear_fake(x, panels, out_features, bias=None):
    return x.new_empty(*x.shape[:-1], out_features)


#: panel-packed: fusion and sharding, which concatenate and split rows, leave these alone (the packing runs after
#: them); every graph calls the operator (the prompts' product too)
F32_PACKED_LINEAR = register_product(ProductOp(
    torch.ops.auto_deploy.f32_packed_linear.default, input_arg="x", row_args=("panels",),
    static_args=("out_features",), row_major=False,
    compile_form=lambda decode: torch.ops.auto_deploy.f32_packed_linear.default))

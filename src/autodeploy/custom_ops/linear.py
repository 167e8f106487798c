"""Float32 linear products: ``aten.linear`` as a product op, and ``auto_deploy::f32_linear``.

    f32_linear(x [..., K], weight [N, K], bias [N]?) -> F.linear(x, weight, bias)

``f32_linear`` is ``F.linear`` with a native kernel: where the kernel builds and runs
(:func:`autodeploy.custom_ops.native.f32_linear_available`), up to
:func:`~autodeploy.custom_ops.native.f32_max_rows` rows (decode batches) are multiplied by a kernel that
streams the weight in its own [N, K] layout (``native/kernels.cpp``), and more rows (prompts) by torch's
fastest float32 GEMM: oneDNN's linear on x86, torch's linear elsewhere. Its float32 sums are ordered
differently from torch's GEMM, so logits differ from ``F.linear``'s by float32 rounding only. Everywhere else
the op is ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils.products import ProductOp, register_product

_LIB = torch.library.Library("auto_deploy", "FRAGMENT")
_LIB.define("f32_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")


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

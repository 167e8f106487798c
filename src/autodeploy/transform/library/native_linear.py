"""post_load_fusion stage: ``native_linear``, float32 linear layers onto the native product kernel.

Every float32 ``aten.linear`` on the CPU whose weight is a contiguous [N, K] tensor with K a multiple of the
vector width (8 floats on AVX2, 16 on AVX-512, 4 on NEON) becomes ``auto_deploy::f32_linear`` with the same
arguments. That operator multiplies up to the build's ``native.f32_max_rows()`` rows (64 on AVX-512 and AVX2,
decode batches of 16 on NEON) with a native kernel (the build for this CPU's instruction set) that streams the
weight in its own layout (``custom_ops/native/kernels.cpp``), and hands more rows to torch's fastest float32
GEMM: oneDNN's linear on x86 (faster there than both the kernel and torch's default, MKL), torch's linear
elsewhere.
``benchmarks/decode_products.py`` measures it against ``F.linear`` and oneDNN's prepacked weights
(docs/performance.md).

The weights stay where they are (no copy, same tensors). Under ``torch-compile`` the prompt graph reads
these nodes as plain linears again (the op's compile form), so Inductor plans its GEMMs as before; the
decode graph calls the operator. Skipped, with the reason logged, where the native kernels do
not run (no C/C++ compiler, neither AVX2 nor NEON, ``AUTODEPLOY_NATIVE_KERNELS=0``); a model without
float32 CPU linears (bf16, GPU) skips it without building the native library.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ...custom_ops import native
from ...custom_ops.linear import F32_LINEAR, LINEAR
from ...utils.fx import get_attr_tensor, node_val
from ...utils.logger import ad_logger
from ...utils.products import Product, product_of, products_of_kind
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry


def _takes(gm: GraphModule, product: Product) -> bool:
    """Whether the native kernel takes this product (:func:`native.f32_linear_takes` on its traced input and
    its weight and bias tensors)."""
    x_val = node_val(product.input)
    attrs = [product.weight] + ([product.bias] if product.bias is not None else [])
    if x_val is None or any(not isinstance(a, Node) or a.op != "get_attr" for a in attrs):
        return False
    weight, *bias = (get_attr_tensor(gm, a.target) for a in attrs)
    if any(not isinstance(t, torch.Tensor) or t.is_meta for t in (weight, *bias)):
        return False
    return native.f32_linear_takes(x_val, weight, bias[0] if bias else None)


@TransformRegistry.register("native_linear")
class NativeLinear(BaseTransform):
    """float32 linears -> ``auto_deploy::f32_linear`` (see the module docstring)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        linears = products_of_kind(gm.graph, LINEAR)
        # checked before the library: a model with no float32 CPU linears (bf16, GPU) never builds it
        taken = [p for p in linears if _takes(gm, p)]
        if not taken:
            return gm, TransformInfo.unchanged()
        if not native.f32_linear_available():
            ad_logger.info("skipped: the native float32 kernel does not run here (see the native kernels' log line)")
            return gm, TransformInfo.unchanged()
        for node in [p.node for p in taken]:
            # read the product again: its input may be a linear replaced a moment ago (chained linears, Zamba2's
            # adapters), which the product read up front still names
            product_of(node).replace(F32_LINEAR)
        ad_logger.info(f"{len(taken)} of {len(linears)} linear(s) -> auto_deploy::f32_linear (native kernel up to "
                       f"{native.f32_max_rows()} rows)")
        return gm, TransformInfo.changed(len(taken), shapes_current=True)

"""post_load_fusion stage: ``native_linear``, float32 linear layers onto the native small-batch kernel.

Every float32 ``aten.linear`` on the CPU whose weight is a contiguous [N, K] tensor with K a multiple of 16
becomes ``auto_deploy::f32_linear`` with the same arguments. That operator multiplies decode batches (up to
16 rows) with a native AVX-512 kernel that streams the weight in its own layout
(``custom_ops/native/f32_small_gemm.c``), and hands more rows (prompts) to torch's linear, bit for bit.
Measured on the README's 125M Llama, 2 cores, all 49 products of a decode step
(``benchmarks/decode_products.py``): 16 rows 33.8 -> 20.7 ms (oneDNN with prepacked weights: 26.0 ms),
8 rows 35.5 -> 16.8 ms, 4 rows 26.6 -> 15.4 ms, one row 14.5 -> 14.2 ms.

The weights stay where they are (no copy, same tensors). Under ``torch-compile`` the prompt graph reads
these nodes as plain linears again (``compile_model``'s compile forms), so Inductor plans its GEMMs as
before; the decode graph calls the operator. Skipped, with the reason logged, where the native kernels do
not run (no C/C++ compiler, not x86, no AVX-512, ``AUTODEPLOY_NATIVE_KERNELS=0``); a model without
float32 CPU linears (bf16, GPU) skips it without building the native library.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ...custom_ops import native
from ...utils.fx import get_attr_tensor
from ...utils.logger import ad_logger
from ..interface import BaseTransform, PipelineContext, TransformConfig, TransformInfo, TransformRegistry, finish_rewrite
from .fusion import linear_parts

aten = torch.ops.aten


def _takes(gm: GraphModule, node: Node) -> bool:
    """Whether the native operator takes this linear (:func:`native.f32_linear_takes` on its traced input
    and its weight and bias tensors)."""
    parts = linear_parts(node)
    if parts is None:
        return False
    x, weight_node, bias_node = parts
    x_val = x.meta.get("val")
    weight = get_attr_tensor(gm, weight_node.target)
    bias = get_attr_tensor(gm, bias_node.target) if bias_node is not None else None
    tensors = [weight] if bias_node is None else [weight, bias]
    if not isinstance(x_val, torch.Tensor) or any(not isinstance(t, torch.Tensor) or t.is_meta for t in tensors):
        return False
    return native.f32_linear_takes(x_val, weight, bias)


@TransformRegistry.register("native_linear")
class NativeLinear(BaseTransform):
    """float32 linears -> ``auto_deploy::f32_linear`` (see the module docstring)."""

    @classmethod
    def get_config_class(cls):
        return TransformConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        linears = gm.graph.find_nodes(op="call_function", target=aten.linear.default)
        # checked before the library: a model with no float32 CPU linears (bf16, GPU) never builds it
        taken = [node for node in linears if _takes(gm, node)]
        if not taken:
            return gm, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        if not native.f32_linear_available():
            ad_logger.info("skipped: the native float32 kernel does not run here (see the native kernels' log line)")
            return gm, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        for node in taken:
            node.target = torch.ops.auto_deploy.f32_linear.default
        ad_logger.info(f"{len(taken)} of {len(linears)} linear(s) -> auto_deploy::f32_linear (native kernel up to "
                       f"{native.F32_LINEAR_NATIVE_MAX_ROWS} rows)")
        return gm, finish_rewrite(gm, len(taken))

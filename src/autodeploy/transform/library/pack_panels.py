"""post_load_fusion stage: ``pack_f32_weights`` and ``pack_half_weights``, float32 and 16-bit weights into the
panels the native x86 kernels read.

Every ``auto_deploy::f32_linear`` (``native_linear``'s operator) whose weight is a ``get_attr`` tensor read by this
product alone becomes ``auto_deploy::f32_packed_linear`` over the same weight packed in panels of 16 rows
(:func:`~autodeploy.custom_ops.linear.pack_f32_panels`): weight k of each of a panel's rows side by side. The
kernel then keeps each output in a vector lane and broadcasts the activations, where ``f32_linear``'s kernel
sums vectors of partial dot products and re-reads every activation row for each tile of 6 weight rows. The
packed op runs every row count (prompts too: the weight is held once, in panels). Measured on the 125M Llama's
49 products, 2 threads, alternating in one process, the AMD EPYC (Zen 5) of docs/performance.md, against
``f32_linear`` (its kernel up to 64 rows, oneDNN's GEMM for more): 1.0-1.1x at 1-4 rows, 1.3-1.5x at 8-16,
1.15x at 64, 1.0x at 128-256 and 0.95x at 2048 on AVX-512 ("Issue 18, twenty-third round"); on AVX2 0.94-1.18x
at 1-64 rows and 1.0-1.08x at 128-2048, and the engine's batch-16 decode 1.07-1.17x faster ("twenty-fourth
round"). Each output is summed over k in order, so a decode row and the same row in a prompt agree bit for bit
(two chains of sums at one row).

Runs after ``native_linear`` and ``fuse_gemms`` (packed weights are not concatenated) and before the cache stage.
The packed copy replaces the weight (held once; a memory-mapped checkpoint's pages are given back). Skipped, with
the reason logged, where the native kernels do not run or their build reads no panels (NEON: untimed on
hardware).

``pack_half_weights`` does the same for ``auto_deploy::half_linear`` (bfloat16 or float16 weights, from
``quantize_weights`` or a 16-bit checkpoint): ``auto_deploy::half_packed_linear`` over the weight's panels in its
own dtype, whose kernel widens each panel row to float32 in registers. Only where the build reads 16-bit panels
(``native.half_pack_width()``: AVX2; on AVX-512 they ran 0.88-0.99x ``half_linear``'s kernel at 1-2 rows). On the
AMD EPYC's AVX2 build, the 125M Llama's bfloat16 products: 1.03-1.4x at one row, 1.1-1.9x at 2-16 rows, 1.13x
at 64, 1.04-1.08x at 512 ("Issue 18, twenty-fourth round").
"""

from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule

from ...custom_ops import native
from ...custom_ops.half_linear import HALF_LINEAR, HALF_PACKED_LINEAR
from ...custom_ops.linear import F32_LINEAR, F32_PACKED_LINEAR, pack_f32_panels
from ...utils.fx import get_attr_tensor, swap_attr_tensors, tensor_name_counts
from ...utils.logger import ad_logger
from ...utils.memory import FilePageReleaser
from ...utils.products import ProductOp, products_of_kind
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry


class PackWeightsConfig(GraphRewriteConfig):
    # the packed weights are new tensors; the originals may stay mapped from the checkpoint file
    expect_mem_change: bool = True


def pack_products(gm: GraphModule, kind: ProductOp, packed: ProductOp, width: Callable[[], int],
                  what: str) -> TransformInfo:
    """Every ``kind`` product whose weight is a ``get_attr`` tensor read by it alone (not tied to another name)
    becomes ``packed`` over the weight in panels (the packed copy replaces it; a memory-mapped checkpoint's pages
    are given back). Skipped, with the reason logged, where ``width()`` is 0."""
    graph = gm.graph
    products = products_of_kind(graph, kind)
    if not products:
        return TransformInfo.unchanged()
    rows = width()
    if rows == 0:
        ad_logger.info(f"skipped: the native kernels do not run here, or their build reads no {what} panels "
                       "(see the native kernels' log line)")
        return TransformInfo.unchanged()
    names = tensor_name_counts(gm)
    releaser = FilePageReleaser([*gm.parameters(), *gm.buffers()])
    count = released = 0
    for product in products:
        attr = product.weight
        if attr.op != "get_attr" or len(attr.users) != 1:
            continue
        weight = get_attr_tensor(gm, attr.target).detach()
        if names.get(weight.data_ptr(), 0) != 1:  # tied to another name (an embedding): left by rows
            continue
        panels = pack_f32_panels(weight)
        released += releaser.release(weight)
        new_attr, = swap_attr_tensors(gm, [attr.target], [(f"{attr.target.replace('.', '_')}_panels", panels)],
                                      product.node, parameter=True)
        product.replace(packed, row_tensors=[new_attr], static={"out_features": weight.shape[0]})
        graph.erase_node(attr)
        count += 1
    if count:
        ad_logger.info(f"{count} of {len(products)} {what} linear(s) -> {packed.op.name()} (panels of {rows} rows; "
                       f"{released / 2**20:.0f} MiB of checkpoint pages released)")
    return TransformInfo.changed(count, shapes_current=True)


@TransformRegistry.register("pack_f32_weights")
class PackF32Weights(BaseTransform):
    """``f32_linear`` -> ``f32_packed_linear`` over panel-packed weights (see the module docstring)."""

    config: PackWeightsConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        return gm, pack_products(gm, F32_LINEAR, F32_PACKED_LINEAR, native.f32_pack_width, "float32")


@TransformRegistry.register("pack_half_weights")
class PackHalfWeights(BaseTransform):
    """``half_linear`` -> ``half_packed_linear`` over panel-packed 16-bit weights (see the module docstring)."""

    config: PackWeightsConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        return gm, pack_products(gm, HALF_LINEAR, HALF_PACKED_LINEAR, native.half_pack_width, "16-bit")

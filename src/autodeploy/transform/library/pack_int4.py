"""post_load_fusion stage: ``pack_int4_weights``, 4-bit weights into the tiles the native x86 kernels read.

Every ``auto_deploy::int4_linear`` whose weight is a ``get_attr`` tensor becomes ``auto_deploy::int4_packed_linear``
over the same weight packed in tiles of ``native.int4_pack_rows()`` rows (8 on AVX2, 16 on AVX-512:
:func:`~autodeploy.custom_ops.int4_linear.pack_int4_tiles`). Same bytes, another order: word j of each of a tile's
rows side by side, so the kernels hold one weight row per vector lane, and a block of 32 weights costs one
broadcast of its activations and one float multiply-add per tile instead of per row. The products are the same
Q4_0 x Q8_0 arithmetic; the decode rows' sums are summed in the prompt products' order, so both agree bit for bit
(the unpacked decode rows summed in another order). Measured on the 125M Llama's 48 layer products, 2 threads,
the Intel Xeon of docs/performance.md: AVX2 1.14x at one row, 1.27x at 2, 1.57x at 4, 1.73x at 16; AVX-512 with
VNNI and AMX 1.05x at one row, 1.42x at 4, 1.86x at 16 ("Issue 18, twenty-first round").

Runs after ``fuse_gemms`` (packed weights are not concatenated) and before the cache stage. Skipped, with the
reason logged, where the native kernels do not run or their build takes no packed layout (NEON).
"""

from __future__ import annotations

from torch.fx import GraphModule

from ...custom_ops import native
from ...custom_ops.int4_linear import DECODE_BLOCK, INT4_LINEAR, INT4_PACKED_LINEAR, pack_int4_tiles
from ...utils.fx import get_attr_tensor, swap_attr_tensors
from ...utils.logger import ad_logger
from ...utils.products import products_of_kind
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry


@TransformRegistry.register("pack_int4_weights")
class PackInt4Weights(BaseTransform):
    """``int4_linear`` -> ``int4_packed_linear`` over tile-packed weights (see the module docstring)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        graph = gm.graph
        products = products_of_kind(graph, INT4_LINEAR)
        if not products:
            return gm, TransformInfo.unchanged()
        rows = native.int4_pack_rows()
        if rows == 0:
            ad_logger.info("skipped: the native kernels do not run here, or their build reads no packed 4-bit "
                           "layout (see the native kernels' log line)")
            return gm, TransformInfo.unchanged()
        count = 0
        for product in products:
            attrs = product.row_tensors
            if (any(a.op != "get_attr" or len(a.users) != 1 for a in attrs)
                    or product.static["group_size"] % DECODE_BLOCK):  # the kernels' activation blocks
                continue
            qweight, scale = (get_attr_tensor(gm, a.target) for a in attrs)
            words, tile_scale = pack_int4_tiles(qweight, scale, rows)
            names = [f"{a.target.replace('.', '_')}_tiles" for a in attrs]
            new_attrs = swap_attr_tensors(gm, [a.target for a in attrs], list(zip(names, (words, tile_scale))),
                                          product.node)
            product.replace(INT4_PACKED_LINEAR, row_tensors=new_attrs,
                            static={**product.static, "out_features": qweight.shape[0]})
            for attr in attrs:
                graph.erase_node(attr)
            count += 1
        if count:
            ad_logger.info(f"{count} of {len(products)} int4 linear(s) -> auto_deploy::int4_packed_linear "
                           f"(tiles of {rows} rows)")
        return gm, TransformInfo.changed(count, shapes_current=True)

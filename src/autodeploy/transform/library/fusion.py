"""post_load_fusion stage: performance rewrites that need the real weights.

- ``fuse_gemms``: products of the same op that read the same input (q/k/v projections, gate/up
  projections) become one product over the concatenated weights followed by a split along the last dim.
  Any op of the product-op registry fuses: each per-output-row tensor is concatenated (int8 weights and
  their scales alike, so fusing after ``quantize_weights`` gives the same products as quantizing the fused
  weight, and the float weights are never copied; int4 products fuse when their group sizes are equal).
  The fused weight replaces the originals: each original is concatenated and then deleted from the graph
  module, so the weights are held once (peak: one group's
  weights extra, while concatenating). Originals that lie in a memory-mapped checkpoint also give back their
  resident pages (``utils.memory.FilePageReleaser``), which the mapping would otherwise keep. A group is
  fused only when every weight (and scale) is a ``get_attr`` read by this product alone (not tied to another
  name), all weights share dtype/device/in-features, and either none or all have a bias (also
  ``get_attr``). Measured gain: docs/performance.md.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from pydantic import Field
from torch.fx import GraphModule, Node

from ...utils.fx import get_attr_tensor, swap_attr_tensors, tensor_name_counts
from ...utils.logger import ad_logger
from ...utils.memory import FilePageReleaser
from ...utils.products import Product, product_of
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten


class FuseGemmsConfig(GraphRewriteConfig):
    min_group_size: int = Field(default=2, ge=2, description="Fuse groups of at least this many linears.")
    # the fused weights are new tensors; the originals may stay mapped from the checkpoint file
    expect_mem_change: bool = True


def _fusable(node: Node) -> Product | None:
    """The product ``node`` computes when its row tensors and bias are all ``get_attr`` nodes (the weights
    this transform may concatenate) holding one row per output feature; None otherwise."""
    product = product_of(node)
    if product is None or not product.kind.row_major or not isinstance(product.input, Node):
        return None
    attrs = product.row_tensors + ([product.bias] if product.bias is not None else [])
    if any(not isinstance(a, Node) or a.op != "get_attr" for a in attrs):
        return None
    return product


def _fusable_groups(gm: GraphModule, min_size: int) -> list[list[Node]]:
    # tensors with several names (tied weights) are left alone: deleting one name would not free them
    counts = tensor_name_counts(gm)
    by_input: dict[tuple, list[Product]] = defaultdict(list)
    for node in gm.graph.nodes:
        product = _fusable(node)
        if product is None:
            continue
        attrs = product.row_tensors + ([product.bias] if product.bias is not None else [])
        if any(len(a.users) != 1 for a in attrs):
            continue
        tensors = [get_attr_tensor(gm, a.target) for a in attrs]
        if any(not isinstance(t, torch.Tensor) or t.is_meta or counts[t.data_ptr()] != 1 for t in tensors):
            continue
        # the same op with the same layout arguments (int4's group size)
        by_input[(product.input, node.target, tuple(sorted(product.static.items())))].append(product)
    groups = []
    for members in by_input.values():
        if len(members) < min_size:
            continue
        weights = [get_attr_tensor(gm, p.weight.target) for p in members]
        has_bias = [p.bias is not None for p in members]
        w0 = weights[0]
        same = all(w.dim() == 2 and w.shape[1] == w0.shape[1] and w.dtype == w0.dtype and w.device == w0.device
                   for w in weights)
        if same and (all(has_bias) or not any(has_bias)):
            groups.append([p.node for p in members])
    return groups


def _fuse_group(gm: GraphModule, nodes: list[Node], index: int, releaser: FilePageReleaser) -> int:
    """Fuse one group in place; returns the bytes of checkpoint pages released."""
    graph = gm.graph
    group = [product_of(node) for node in nodes]  # read now: fusing an earlier group may have changed inputs
    columns = list(zip(*(p.row_tensors for p in group)))  # [weights], or [q's], [scales]
    bias_nodes = [p.bias for p in group]
    sizes = [int(get_attr_tensor(gm, w.target).shape[0]) for w in columns[0]]

    buffers = {name for name, _ in gm.named_buffers()}
    members = set(nodes)
    first = next(n for n in graph.nodes if n in members)
    released = 0

    def fuse(attr_nodes: list[Node], name: str) -> Node:
        """One tensor concatenating ``attr_nodes``' in place of them (the only copy), read before ``first``."""
        nonlocal released
        originals = [get_attr_tensor(gm, a.target).detach() for a in attr_nodes]
        fused = torch.cat(originals, dim=0)
        released += sum(releaser.release(t) for t in originals)
        as_buffer = attr_nodes[0].target in buffers  # int8 weights and their scales are buffers
        return swap_attr_tensors(gm, [a.target for a in attr_nodes], [(name, fused)], first,
                                 parameter=not as_buffer)[0]

    attrs = [fuse(list(column), f"fused_gemm_{kind}_{index}") for column, kind in zip(columns, ("weight", "scale"))]
    b = fuse(bias_nodes, f"fused_gemm_bias_{index}") if bias_nodes[0] is not None else None
    with graph.inserting_before(first):
        fused = group[0].kind.call(graph, group[0].input, attrs, b, group[0].static)
        split = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
        outs = [graph.call_function(operator.getitem, (split, i)) for i in range(len(nodes))]
    for node, out in zip(nodes, outs):
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    for a in [a for column in columns for a in column] + [b for b in bias_nodes if b is not None]:
        graph.erase_node(a)
    return released


@TransformRegistry.register("fuse_gemms")
class FuseGemms(BaseTransform):
    """Products sharing an input -> one product over concatenated weights + split (see the module docstring)."""

    config: FuseGemmsConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        groups = _fusable_groups(gm, self.config.min_group_size)
        start = sum(1 for name, _ in [*gm.named_parameters(), *gm.named_buffers()]
                    if name.startswith("fused_gemm_weight_"))
        releaser = FilePageReleaser([*gm.parameters(), *gm.buffers()])
        released = sum(_fuse_group(gm, nodes, start + i, releaser) for i, nodes in enumerate(groups))
        if groups:
            ad_logger.info(f"fused {sum(len(g) for g in groups)} linears into {len(groups)} GEMMs"
                           + (f" ({released / 2**20:.1f} MiB of memory-mapped checkpoint pages released)"
                              if released else ""))
        return gm, TransformInfo.changed(len(groups))

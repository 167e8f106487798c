"""cache_init stage: ``gather_logits_before_lm_head``, logits only for the tokens the sampler needs.

Adds the graph input ``logits_idx`` [N] int64 (after the cache metadata of ``insert_cached_attention``) and
selects those token rows: before the LM head's product when only per-token elementwise ops (casts, logit
soft-capping) follow it, so a prompt's head is computed for its last token only, else on the logits. The
LM head is whatever the product-op registry calls a product (a plain, int8 or native linear). The
runtime passes each sequence's last token; without this transform it takes them from the full logits.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ...runtime.kv_cache import KV_CACHE_META_KEY
from ...runtime.sequence_info import LOGITS_IDX
from ...utils.fx import add_placeholder, fake_input, graph_fake_mode
from ...utils.logger import ad_logger
from ...utils.products import product_of
from ..interface import BaseTransform, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten

# elementwise ops that may sit between the LM head and the output (casts, logit soft-capping)
_PER_TOKEN_OPS = {aten._to_copy.default, aten.to.dtype, aten.tanh.default, aten.div.Tensor, aten.mul.Tensor,
                  aten.div.Scalar, aten.mul.Scalar, aten.clone.default}


def _lm_head(logits: Node) -> Node | None:
    """The product that computes ``logits``, through per-token elementwise ops only; None if there is none."""
    node = logits
    while (
        isinstance(node, Node) and node.op == "call_function" and node.target in _PER_TOKEN_OPS
        and all(not isinstance(a, Node) for a in node.args[1:]) and isinstance(node.args[0], Node)
    ):
        node = node.args[0]
    return node if product_of(node) is not None else None


def gather_logits(gm: GraphModule, logits_idx: Node) -> str:
    """Select the ``logits_idx`` tokens (see the module docstring). Returns where it gathered."""
    output = gm.graph.output_node()
    outs = output.args[0]
    logits = outs[0] if isinstance(outs, (tuple, list)) else outs
    head = _lm_head(logits)
    if head is not None:
        hidden = product_of(head).input
        with gm.graph.inserting_before(head):
            picked = gm.graph.call_function(aten.index_select.default, (hidden, 1, logits_idx))
        head.replace_input_with(hidden, picked)
        return "before the lm head"
    with gm.graph.inserting_before(output):
        picked = gm.graph.call_function(aten.index_select.default, (logits, 1, logits_idx))
    output.args = (type(outs)([picked, *outs[1:]]),) if isinstance(outs, (tuple, list)) else (picked,)
    return "on the logits"


@TransformRegistry.register("gather_logits_before_lm_head")
class GatherLogitsBeforeLMHead(BaseTransform):
    """Add ``logits_idx`` and gather those tokens' logits, before the LM head where possible."""

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        if KV_CACHE_META_KEY not in gm.meta:  # the runtime's calling convention starts at cache_init
            return gm, TransformInfo.unchanged()
        if LOGITS_IDX in [n.name for n in gm.graph.find_nodes(op="placeholder")]:
            return gm, TransformInfo.unchanged()
        val = fake_input(graph_fake_mode(gm), LOGITS_IDX, ("num_logits",), torch.long)
        where = gather_logits(gm, add_placeholder(gm, LOGITS_IDX, val))
        ad_logger.info(f"logits gathered {where}")
        return gm, TransformInfo.changed(1)

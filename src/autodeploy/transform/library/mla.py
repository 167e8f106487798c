"""pattern_matcher stage: multi-head latent attention -> ``auto_deploy::torch_mla`` (opt-in).

``match_mla_attention`` finds the canonical ``torch_attention`` (layout bsnd) of an MLA layer, as HF's DeepSeek
family computes it and the earlier matchers leave it::

    kv = linear(kv_latent, kv_b_weight).view(b, s, n, nope + v).transpose(1, 2)
    k_nope, v = split(kv, [nope, v], -1)
    key = cat(k_nope, k_pe.expand(-1, n, -1, -1), -1)          # k_pe [b, 1, s, rope]: one shared head
    query = cat(q_nope, q_pe, -1)
    torch_attention(query.transpose(1, 2), key.transpose(1, 2), v.transpose(1, 2), layout="bsnd")

and replaces it with ``torch_mla(q_nope, q_pe, kv_latent, k_pe, kv_b_weight, scale)`` over the latent itself, so
that ``insert_cached_attention`` caches the latent and the rope key (``torch_cached_mla``'s compact cache)
instead of the expanded keys and values. Only causal attention without sinks, window or soft-cap qualifies.
Off by default (``enabled: false``): the expanded form shards by heads and takes the native decode kernel,
this one caches ``n * (nope + rope + v) / (kv_lora_rank + rope)`` times less.

Run after ``eliminate_redundant_transposes``. The graph stays clean; shapes are re-propagated.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ...utils.fx import is_call, node_val, op_args, sizes_equal, static_int
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten
ATTENTION = torch.ops.auto_deploy.torch_attention.default
MLA = torch.ops.auto_deploy.torch_mla.default
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _is_view(node) -> bool:
    return any(is_call(node, target) for target in _VIEWS)


def _swap12_source(node) -> Node | None:
    """``x`` when ``node`` is ``x.transpose(1, 2)`` of a 4D ``x``."""
    if not is_call(node, aten.transpose.int) or node_val(node.args[0]) is None or node_val(node).dim() != 4:
        return None
    return node.args[0] if {node.args[1] % 4, node.args[2] % 4} == {1, 2} else None


def _cat_last(node, parts: int = 2) -> list[Node] | None:
    """The inputs of ``cat(inputs, -1)`` of 4D tensors."""
    if not is_call(node, aten.cat.default) or len(node.args[0]) != parts:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return list(node.args[0]) if dim % 4 == 3 else None


def _split_part(node) -> tuple[Node, int, list[int]] | None:
    """(source, index, sizes) of ``split_with_sizes(source, sizes, -1)[index]``."""
    if not is_call(node, operator.getitem) or not is_call(node.args[0], aten.split_with_sizes.default):
        return None
    split = node.args[0]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim % 4 != 3:
        return None
    return split.args[0], node.args[1], list(split.args[1])


def _kv_projection(kv_heads: Node, n_heads: int, per_head: int) -> tuple[Node, Node] | None:
    """(kv_latent [b, s, lora], kv_b_weight) of ``linear(latent, weight).view(b, s, n, per_head).transpose(1, 2)``,
    the latent as [b, s, lora] (undoing the [b, 1, s, lora] view HF gives it)."""
    view = _swap12_source(kv_heads)
    if view is None or not _is_view(view) or not is_call(view.args[0], aten.linear.default):
        return None
    linear = view.args[0]
    if len(linear.args) > 2 and linear.args[2] is not None:
        return None
    latent, weight = linear.args[0], linear.args[1]
    wv, vv = node_val(weight), node_val(view)
    if wv is None or wv.dim() != 2 or static_int(wv.shape[0]) != n_heads * per_head:
        return None
    if not (sizes_equal(vv.shape[2], n_heads) and sizes_equal(vv.shape[3], per_head)):
        return None
    lv = node_val(latent)
    if lv is not None and lv.dim() == 4 and _is_view(latent) and sizes_equal(lv.shape[1], 1):
        latent = latent.args[0]  # [b, s, lora] viewed as one head [b, 1, s, lora]
        lv = node_val(latent)
    if lv is None or lv.dim() != 3 or not all(sizes_equal(lv.shape[i], vv.shape[i]) for i in (0, 1)):
        return None
    return latent, weight


def _match(node: Node) -> dict | None:
    """The torch_mla arguments of an MLA ``torch_attention`` node, or None."""
    args = op_args(node)
    if args["layout"] != "bsnd" or not args["is_causal"] or args["attn_mask"] is not None:
        return None
    if any(args[f] is not None for f in ("sinks", "sliding_window", "logit_cap")) or args["dropout_p"]:
        return None
    q_parts = _cat_last(_swap12_source(args["query"]))
    k_parts = _cat_last(_swap12_source(args["key"]))
    v = _split_part(_swap12_source(args["value"]))
    if q_parts is None or k_parts is None or v is None:
        return None
    k_nope = _split_part(k_parts[0])
    if k_nope is None or k_nope[0] is not v[0] or (k_nope[1], v[1]) != (0, 1) or len(v[2]) != 2:
        return None
    nope, v_dim = v[2]
    expand = k_parts[1]
    if not is_call(expand, aten.expand.default):
        return None
    k_pe = expand.args[0]
    qv, kpv = node_val(q_parts[0]), node_val(k_pe)
    if qv is None or kpv is None or kpv.dim() != 4 or not sizes_equal(kpv.shape[1], 1):
        return None
    n_heads = static_int(qv.shape[1])
    if n_heads is None or not sizes_equal(qv.shape[-1], nope):
        return None
    projection = _kv_projection(v[0], n_heads, nope + v_dim)
    if projection is None:
        return None
    return dict(q_nope=q_parts[0], q_pe=q_parts[1], k_pe=k_pe, latent=projection[0], weight=projection[1],
                scale=args["scale"])


def _to_bsnd(graph, x: Node) -> Node:
    return _swap12_source(x) or graph.call_function(aten.transpose.int, (x, 1, 2))


@TransformRegistry.register("match_mla_attention")
class MatchMLAAttention(BaseTransform):
    """An MLA layer's ``torch_attention`` over keys/values expanded from a kv latent -> ``torch_mla`` on it."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        graph = gm.graph
        for node in list(graph.find_nodes(op="call_function", target=ATTENTION)):
            found = _match(node)
            if found is None:
                continue
            with graph.inserting_before(node):
                q_nope, q_pe = (_to_bsnd(graph, found[k]) for k in ("q_nope", "q_pe"))
                k_pe = graph.call_function(aten.squeeze.dim, (_to_bsnd(graph, found["k_pe"]), 2))  # [b, s, rope]
                mla = graph.call_function(MLA, (q_nope, q_pe, found["latent"], k_pe, found["weight"]),
                                          {"scale": found["scale"]})
            for key in ("stack_trace", "nn_module_stack"):
                if key in node.meta:
                    mla.meta[key] = node.meta[key]
            node.replace_all_uses_with(mla)
            graph.erase_node(node)
            num += 1
        if num:
            graph.eliminate_dead_code()
        return gm, TransformInfo.changed(num)

"""pattern_matcher stage: every attention, whatever the HF code looked like, becomes
``auto_deploy::torch_attention`` in the ``bsnd`` layout. Run in this order:

1. ``match_repeat_kv``: HF's ``repeat_kv`` (``x[:, :, None].expand(b, n, rep, s, d).reshape(b, n*rep, s, d)``)
   -> ``auto_deploy::torch_repeat_kv(x, rep)``.
2. ``match_eager_attention``: HF eager attention, ``softmax(q @ k^T * scale [soft-cap] [+ mask]
   [sinks: cat + max-sub + slice], fp32) [.to] [dropout] @ v`` -> ``torch_attention`` (layout bnsd).
3. ``match_sdpa_to_torch_attention``: ``aten.scaled_dot_product_attention`` -> ``torch_attention``
   (layout bnsd, ``enable_gqa`` needs nothing: torch_attention is grouped-query by itself).
4. ``match_grouped_attention``: ``torch_attention`` whose k and v are ``torch_repeat_kv`` -> the
   un-repeated k/v (grouped-query attention, no copy of the kv heads).
5. ``match_attention_layout``: every ``torch_attention`` gets ``layout="bsnd"`` (transposes around it).

``eliminate_redundant_transposes`` (in :mod:`.cleanup`) then removes the transpose pairs that cancel.

Masks. The HF mask (built from ``position_ids`` with arange/index/le/eq/cumsum, passed as an additive
float or boolean mask) is dropped: ``torch_attention`` is causal by itself (``is_causal=True``; an
attention with neither a mask nor SDPA's ``is_causal`` stays unmasked, ``is_causal=False``). This assumes the standard
positions ``0..n-1`` per sequence (no packed sequences, no padding inside the graph's batch), which is
the graph contract before ``cache_init``. A sliding window is taken from the model config
(``sliding_window``, per layer through ``layer_types`` when present, ``use_sliding_window`` when the
config has it; GPT-Neo's ``window_size`` for its ``"local"`` ``attention_layers``); an attention node is
mapped to its layer through ``node.meta["nn_module_stack"]`` (``...layers.<i>...``), else through the
order of attention nodes in the graph.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from typing import Literal

import torch
from pydantic import Field
from torch.fx import GraphModule, Node

from ...utils.fx import node_val, sizes_equal, static_int
from ...utils.logger import ad_logger
from ...utils.pattern import match_expr
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _erase_unused(gm: GraphModule, nodes) -> None:
    """Erase the replaced nodes that nothing uses any more. ``eliminate_dead_code`` keeps ops that FX
    deems impure (dropout and SDPA are "nondeterministic_seeded"), so replaced ones go explicitly."""
    pending = [n for n in nodes if isinstance(n, Node)]
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if not n.users and n.graph is gm.graph:
                gm.graph.erase_node(n)
                pending.remove(n)
                changed = True


def _copy_meta(new: Node, old: Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


_LAYER_RE = re.compile(r"(?:^|\.)layers?\.(\d+)(?:\.|$)")


def _layer_index(node: Node) -> int | None:
    """The decoder layer a node was traced in, from export's ``nn_module_stack`` (deepest first)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        found = _LAYER_RE.search(str(path))
        if found:
            return int(found.group(1))
    return None


def _sliding_window(config, layer: int | None) -> int | None:
    """The sliding window of ``layer`` per the HF config (None: full attention)."""
    if config is None:
        return None
    local = getattr(config, "attention_layers", None)  # GPT-Neo: "global" / "local" per layer, window_size
    if local and getattr(config, "window_size", None) and layer is not None and 0 <= layer < len(local):
        return int(config.window_size) if local[layer] == "local" else None
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer is not None and 0 <= layer < len(layer_types):
        return int(window) if layer_types[layer] == "sliding_attention" else None
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _attention_layers(nodes: list[Node]) -> list[int]:
    """Layer index per attention node: nn_module_stack when every node has one, else graph order."""
    found = [_layer_index(n) for n in nodes]
    if all(i is not None for i in found) and len(set(found)) == len(found):
        return found
    return list(range(len(nodes)))


def _insert_attention(gm: GraphModule, anchor: Node, q, k, v, *, scale, is_causal: bool = True, sinks=None,
                      sliding_window=None, logit_cap=None, dropout_p: float = 0.0, layout: str = "bnsd") -> Node:
    with gm.graph.inserting_before(anchor):
        new = gm.graph.call_function(
            torch.ops.auto_deploy.torch_attention.default,
            args=(q, k, v),
            kwargs=dict(attn_mask=None, dropout_p=dropout_p, is_causal=is_causal, scale=scale, sinks=sinks,
                        sliding_window=sliding_window if is_causal else None, logit_cap=logit_cap, layout=layout),
        )
    _copy_meta(new, anchor)
    return new


# ------------------------------------------------------------------------------------------------
# patterns (Inductor's pattern language, matched at one anchor node with utils.pattern.match_expr)
# ------------------------------------------------------------------------------------------------
_RESHAPES = [aten.reshape.default, aten.view.default, aten._unsafe_view.default]
_CASTS = [aten.to.dtype, aten._to_copy.default]


@functools.lru_cache(maxsize=None)
def _repeat_kv_pattern():
    from torch._inductor.pattern_matcher import CallFunction, Ignored, KeywordArg

    unsqueezed = CallFunction(aten.unsqueeze.default, KeywordArg("x"), 2)
    expanded = CallFunction(aten.expand.default, unsqueezed, Ignored())
    return CallFunction(_RESHAPES, expanded, Ignored())


@functools.lru_cache(maxsize=None)
def _eager_patterns():
    """Every supported variant of HF eager attention, anchored at the final ``probs @ v`` matmul.

    Variants: scale by mul or div; Gemma-2 soft-capping ``tanh(s / cap) * cap`` (before the mask);
    an additive mask or none; gpt-oss sinks ``cat([s, sinks.reshape(1,-1,1,1).expand(...)], -1)``, with
    or without the ``- max`` stabilisation, softmax, ``[..., :-1]``; softmax with or without dtype;
    an optional cast back and an optional dropout.
    """
    from torch._inductor.pattern_matcher import CallFunction, Ignored, KeywordArg

    patterns = []
    for scale_op in (aten.mul.Tensor, aten.div.Tensor):
        for softcap in (False, True):
            for mask in (False, True):
                for sinks in (None, "plain", "max"):
                    for softmax in ("int3", "int2", "_softmax"):
                        for cast in (False, True):
                            for dropout in (False, True):
                                k_t = CallFunction(aten.transpose.int, KeywordArg("k"), KeywordArg("kdim0"),
                                                   KeywordArg("kdim1"))
                                s = CallFunction(aten.matmul.default, KeywordArg("q"), k_t)
                                s = CallFunction(scale_op, s, KeywordArg("scale"))
                                if softcap:
                                    s = CallFunction(aten.div.Tensor, s, KeywordArg("cap"))
                                    s = CallFunction(aten.tanh.default, s)
                                    s = CallFunction(aten.mul.Tensor, s, KeywordArg("cap2"))
                                if mask:
                                    s = CallFunction(aten.add.Tensor, s, KeywordArg("mask"))
                                if sinks is not None:
                                    sink = CallFunction(_RESHAPES, KeywordArg("sinks"), Ignored())
                                    sink = CallFunction(aten.expand.default, sink, Ignored())
                                    if sinks == "max":
                                        cat = CallFunction(aten.cat.default, [s, sink], -1, _users=2)
                                        mx = CallFunction(aten.max.dim, cat, -1, True)
                                        mx = CallFunction(operator.getitem, mx, 0)
                                        s = CallFunction(aten.sub.Tensor, cat, mx)
                                    else:
                                        s = CallFunction(aten.cat.default, [s, sink], -1)
                                if softmax == "int3":
                                    p = CallFunction(aten.softmax.int, s, -1, Ignored())
                                elif softmax == "int2":
                                    p = CallFunction(aten.softmax.int, s, -1)
                                else:
                                    p = CallFunction(aten._softmax.default, s, -1, False)
                                if sinks is not None:
                                    p = CallFunction(aten.slice.Tensor, p, Ignored(), 0, -1)
                                if cast:
                                    p = CallFunction(_CASTS, p, Ignored())
                                if dropout:
                                    p = CallFunction(aten.dropout.default, p, KeywordArg("dropout_p"), Ignored())
                                out = CallFunction(aten.matmul.default, p, KeywordArg("v"))
                                patterns.append((out, dict(softcap=softcap, sinks=sinks is not None, mask=mask,
                                                           scale_op=scale_op)))
    return patterns


# ------------------------------------------------------------------------------------------------
# 1. repeat_kv
# ------------------------------------------------------------------------------------------------
@TransformRegistry.register("match_repeat_kv")
class MatchRepeatKV(BaseTransform):
    """HF ``repeat_kv`` (unsqueeze(2) / expand / reshape of a [b, n_kv, s, d] tensor) ->
    ``auto_deploy::torch_repeat_kv(x, n_rep)``."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        pattern = _repeat_kv_pattern()
        num = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in _RESHAPES:
                continue
            m = match_expr(pattern, node)
            if m is None:
                continue
            x = m.kwargs["x"]
            expand = node.args[0]
            x_val, e_val, out_val = node_val(x), node_val(expand), node_val(node)
            if x_val is None or e_val is None or out_val is None or x_val.dim() != 4 or e_val.dim() != 5:
                continue
            n_kv, n_rep = static_int(x_val.shape[1]), static_int(e_val.shape[2])
            if n_kv is None or n_rep is None or static_int(out_val.shape[1]) != n_kv * n_rep:
                continue
            # the expand must only broadcast the new dim: [b, n, rep, s, d] from [b, n, 1, s, d]
            if not all(sizes_equal(e_val.shape[i], x_val.shape[j]) for i, j in ((0, 0), (1, 1), (3, 2), (4, 3))):
                continue
            if not (sizes_equal(out_val.shape[0], x_val.shape[0]) and sizes_equal(out_val.shape[2], x_val.shape[2])
                    and sizes_equal(out_val.shape[3], x_val.shape[3])):
                continue
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(torch.ops.auto_deploy.torch_repeat_kv.default, args=(x, n_rep))
            _copy_meta(new, node)
            node.replace_all_uses_with(new)
            num += 1
        return gm, TransformInfo.changed(num)


# ------------------------------------------------------------------------------------------------
# 2. eager attention
# ------------------------------------------------------------------------------------------------
def _literal(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


@TransformRegistry.register("match_eager_attention")
class MatchEagerAttention(BaseTransform):
    """HF eager attention (matmul-softmax-matmul) -> ``torch_attention`` (layout bnsd).

    The scale and soft-cap come from the graph's literals (soft-cap cross-checked with the config's
    ``attn_logit_softcapping``); the mask is dropped (see the module docstring); sinks are the
    ``sinks`` tensor the graph concatenates to the logits; dropout must be 0 (inference).
    """

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        config = ctx.text_config()
        found: list[tuple[Node, dict]] = []
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target != aten.matmul.default:
                continue
            for pattern, variant in _eager_patterns():
                m = match_expr(pattern, node)
                if m is not None:
                    params = self._params(m.kwargs, variant, config)
                    if params is not None:
                        found.append((node, params, list(m.nodes)))
                    break
        layers = _attention_layers([n for n, _, _ in found])
        for (node, params, covered), layer in zip(found, layers):
            new = _insert_attention(gm, node, params["q"], params["k"], params["v"], scale=params["scale"],
                                    is_causal=params["is_causal"], sinks=params["sinks"], logit_cap=params["logit_cap"],
                                    sliding_window=_sliding_window(config, layer))
            node.replace_all_uses_with(new)
            _erase_unused(gm, covered)
        return gm, TransformInfo.changed(len(found))

    @staticmethod
    def _params(kw: dict, variant: dict, config) -> dict | None:
        q, k, v = kw["q"], kw["k"], kw["v"]
        q_val, k_val, v_val = node_val(q), node_val(k), node_val(v)
        if q_val is None or k_val is None or v_val is None or q_val.dim() != 4 or k_val.dim() != 4:
            return None
        if {kw["kdim0"] % 4, kw["kdim1"] % 4} != {2, 3}:  # k^T over the last two dims
            return None
        scale = _literal(kw["scale"])
        if scale is None or scale == 0:
            return None
        if variant["scale_op"] == aten.div.Tensor:
            scale = 1.0 / scale
        dropout_p = kw.get("dropout_p", 0.0)
        if not isinstance(dropout_p, (int, float)) or dropout_p != 0:  # inference only
            return None
        logit_cap = None
        if variant["softcap"]:
            cap, cap2 = _literal(kw["cap"]), _literal(kw["cap2"])
            if cap is None or cap != cap2:
                return None
            logit_cap = cap
            configured = getattr(config, "attn_logit_softcapping", None) if config is not None else None
            if configured is not None and not math.isclose(configured, cap):
                ad_logger.warning(
                    f"eager attention soft-cap {cap} differs from config attn_logit_softcapping={configured}"
                )
        sinks = None
        if variant["sinks"]:
            sinks = kw["sinks"]
            s_val = node_val(sinks)
            if s_val is None or s_val.numel() != q_val.shape[1]:
                return None
        # a mask is the HF causal (or sliding-window) mask: dropped, the op is causal; none: no masking
        return dict(q=q, k=k, v=v, scale=scale, logit_cap=logit_cap, sinks=sinks, is_causal=variant["mask"])


# ------------------------------------------------------------------------------------------------
# 3. SDPA
# ------------------------------------------------------------------------------------------------
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@TransformRegistry.register("match_sdpa_to_torch_attention")
class MatchSDPAToTorchAttention(BaseTransform):
    """``aten.scaled_dot_product_attention`` -> ``torch_attention`` (layout bnsd, causal, mask dropped)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        config = ctx.text_config()
        nodes = list(gm.graph.find_nodes(op="call_function", target=aten.scaled_dot_product_attention.default))
        for node, layer in zip(nodes, _attention_layers(nodes)):
            args = dict(zip(_SDPA_ARGS, node.args))
            args.update(node.kwargs)
            dropout_p = args.get("dropout_p", 0.0)
            # a mask is the HF causal (or sliding-window) mask: dropped, the op is causal
            is_causal = bool(args.get("is_causal", False)) or args.get("attn_mask") is not None
            new = _insert_attention(gm, node, args["query"], args["key"], args["value"], scale=args.get("scale"),
                                    is_causal=is_causal,
                                    dropout_p=float(dropout_p) if isinstance(dropout_p, (int, float)) else 0.0,
                                    sliding_window=_sliding_window(config, layer))
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
        return gm, TransformInfo.changed(len(nodes))


# ------------------------------------------------------------------------------------------------
# 4. grouped attention
# ------------------------------------------------------------------------------------------------
@TransformRegistry.register("match_grouped_attention")
class MatchGroupedAttention(BaseTransform):
    """``torch_attention(q, repeat_kv(k, r), repeat_kv(v, r))`` -> ``torch_attention(q, k, v)``."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        ops = torch.ops.auto_deploy
        num = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=ops.torch_attention.default)):
            k, v = node.args[1], node.args[2]
            if not all(isinstance(t, Node) and t.target == ops.torch_repeat_kv.default for t in (k, v)):
                continue
            if k.args[1] != v.args[1] or node.kwargs.get("layout", "bnsd") != "bnsd":
                continue
            node.args = (node.args[0], k.args[0], v.args[0], *node.args[3:])
            num += 1
        return gm, TransformInfo.changed(num)


# ------------------------------------------------------------------------------------------------
# 5. layout
# ------------------------------------------------------------------------------------------------
class AttentionLayoutConfig(GraphRewriteConfig):
    layout: Literal["bsnd", "bnsd"] = Field(default="bsnd", description="The layout every torch_attention gets.")


@TransformRegistry.register("match_attention_layout")
class MatchAttentionLayout(BaseTransform):
    """Every ``torch_attention`` in the configured layout (default ``bsnd``): transposes are inserted
    around the op; ``eliminate_redundant_transposes`` then removes the pairs that cancel."""

    config: AttentionLayoutConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        target_layout = self.config.layout
        num = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.torch_attention.default)):
            kwargs = dict(node.kwargs)
            layout = kwargs.get("layout", node.args[10] if len(node.args) > 10 else "bnsd")
            if layout == target_layout:
                continue
            with gm.graph.inserting_before(node):
                qkv = [gm.graph.call_function(aten.transpose.int, args=(t, 1, 2)) for t in node.args[:3]]
            kwargs["layout"] = target_layout
            node.args = (*qkv, *node.args[3:10])
            node.kwargs = kwargs
            with gm.graph.inserting_after(node):
                back = gm.graph.call_function(aten.transpose.int, args=(node, 1, 2))
            node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
            for new in (*qkv, back):
                _copy_meta(new, node)
            num += 1
        return gm, TransformInfo.changed(num)


# ------------------------------------------------------------------------------------------------
# 6. redundant transposes
# ------------------------------------------------------------------------------------------------

"""pattern_matcher stage: ``match_attention_chain``, the attention forms the pattern set of
``match_eager_attention`` does not list, found by walking the graph instead of matching a fixed tree.

It starts at each ``softmax`` left in the graph, walks forward to ``probs @ v`` (through casts, views and
no-op dropouts: ``p == 0`` or ``train=False``) and backward over the score chain to ``q @ k^T``, taking
each step's meaning from its op:

- products: ``matmul`` of 4-D [b, h, s, d] tensors, or ``bmm`` of 3-D [b*h, s, d] reshapes of them
  (``baddbmm(bias, q, k^T, beta=1, alpha)`` too, the bias zeros or ALiBi); k^T by transpose or permute;
- scale: ``mul``/``div`` by a literal (none at all: scale 1, as GPT-Neo; q scaled before is then exact);
  ``x - x.max(-1, keepdim=True)`` before the softmax is dropped (the same softmax; MiMo-V2);
- masks, dropped (``torch_attention`` is causal, see :mod:`.attention`): ``add``, ``where``,
  ``masked_fill`` or a multiplicative 0/1 ``mul`` whose operand is computed without model parameters and
  broadcasts over heads; a ``max``/``clamp_min`` at a value below -1e30 (a no-op for finite scores);
- ALiBi: an added bias ``slopes * arange`` (key positions along the last axis, through views, slices,
  repeats and casts) with ``n_heads`` slopes -> ``alibi_slopes`` (the slopes' node, computed by the graph);
- attention sinks applied after the product, ``out * sigmoid(logsumexp(scores) - sinks)`` (Granite-SWA):
  the same as a sink logit in the softmax normalizer -> ``sinks``.

Anything else on the chain (a learned bias, a soft-cap, a non-literal scale) leaves the attention
unmatched. Sliding windows come from the config, as for the other attention matchers.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from ...utils.fx import get_attr_tensor, node_val, sizes_equal, static_int
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry
from .attention import _attention_layers, _erase_unused, _insert_attention, _sliding_window

aten = torch.ops.aten

_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
_NOOPS = (aten.alias.default, aten.clone.default, aten.contiguous.default, aten.detach.default,
          aten.lift_fresh_copy.default, aten.detach_.default)
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
#: ops that only move or broadcast a bias's elements (the ALiBi walk)
_LAYOUT_OPS = (*_RESHAPES, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default,
               aten.repeat.default, aten.slice.Tensor, *_CASTS, *_NOOPS)
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_VERY_NEGATIVE = -1e30


def _call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _literal(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _is_noop_dropout(node: Node) -> bool:
    if not _call(node, aten.dropout.default):
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.0)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return train is False or p == 0


def _dims(node) -> tuple | None:
    val = node_val(node)
    return tuple(val.shape) if val is not None else None


@dataclass
class _Chain:
    """What the walk found for one attention."""

    q: Node
    k: Node  # [b, h_kv, kv, d]
    v: Node
    anchor: Node  # the node whose uses the attention output replaces
    flat: bool  # the anchor is [b*h, s, d] (bmm form)
    scale: float = 1.0
    masked: bool = False
    alibi_slopes: Node | None = None
    sinks: Node | None = None
    covered: list[Node] = field(default_factory=list)


class _Walker:
    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.params = {name for name, _ in gm.named_parameters()}
        self._param_free: dict[Node, bool] = {}

    # -- operands -------------------------------------------------------------------------------
    def param_free(self, node) -> bool:
        """Whether ``node`` is computed without any model parameter or float input, sizes aside (masks and
        position biases are; scores and learned biases are not)."""
        if not isinstance(node, Node):
            return True
        if node not in self._param_free:
            stack, seen, free = [node], set(), True
            while stack and free:
                n = stack.pop()
                if n in seen:
                    continue
                seen.add(n)
                if n in self._param_free:
                    free = self._param_free[n]
                elif isinstance(n.meta.get("val"), (int, torch.SymInt)):
                    continue  # a size, not data
                elif n.op == "get_attr" and n.target in self.params:
                    free = False
                elif n.op == "placeholder" and node_val(n) is not None and node_val(n).is_floating_point():
                    free = False
                else:
                    stack.extend(n.all_input_nodes)
            self._param_free[node] = free
        return self._param_free[node]

    def is_mask(self, node, scores: Node) -> bool:
        """A mask operand: parameter-free and broadcast over heads (4-D scores, size 1 at dim 1)."""
        if not isinstance(node, Node) or not self.param_free(node):
            return False
        shape, s_shape = _dims(node), _dims(scores)
        if shape is None or s_shape is None or len(s_shape) != 4:
            return False
        return len(shape) <= 2 or (len(shape) == 4 and static_int(shape[1]) == 1)

    def alibi(self, bias, n_heads: int) -> Node | None:
        """The slopes node of an ALiBi bias ``slopes * arange`` (see the module docstring), or None."""
        shape = _dims(bias)
        if shape is None or len(shape) < 2 or not sizes_equal(shape[-2], 1) or not self.param_free(bias):
            return None  # the bias varies with the key only
        node = bias
        while _call(node, *_LAYOUT_OPS):
            if _call(node, aten.slice.Tensor) and not self._slices_last_dim(node):
                return None
            node = node.args[0]
        if not _call(node, aten.mul.Tensor):
            return None
        for slopes, pos in (node.args, node.args[::-1]):
            if self._positions(pos) and self._slopes(slopes, n_heads):
                root = slopes
                while _call(root, *_RESHAPES, aten.unsqueeze.default, *_CASTS, *_NOOPS):
                    root = root.args[0]
                return root
        return None

    @staticmethod
    def _slices_last_dim(node: Node) -> bool:
        dim = node.args[1] if len(node.args) > 1 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        ndim = len(_dims(node) or ())
        return step == 1 and dim in (-1, ndim - 1)

    def _positions(self, node) -> bool:
        """A step-1 ``arange`` along the last axis (key positions), through views, slices and casts."""
        shape = _dims(node)
        if shape is None or not all(static_int(s) == 1 for s in shape[:-1]):
            return False
        while _call(node, *_RESHAPES, aten.unsqueeze.default, aten.slice.Tensor, *_CASTS, *_NOOPS):
            if _call(node, aten.slice.Tensor) and not _Walker._slices_last_dim(node):
                return False
            node = node.args[0]
        if not _call(node, *_ARANGES):
            return False
        return node.target != aten.arange.start_step or node.args[2] == 1

    @staticmethod
    def _slopes(node, n_heads: int) -> bool:
        """One float per head, constant along the key axis (the last)."""
        val = node_val(node)
        return (val is not None and val.is_floating_point() and val.numel() == n_heads
                and (val.dim() == 1 or static_int(val.shape[-1]) == 1))

    # -- the walk -------------------------------------------------------------------------------
    def match(self, softmax: Node) -> _Chain | None:
        if softmax.args[1] not in (-1, len(_dims(softmax) or ()) - 1):
            return None
        pv, probs_path = self._forward_to_pv(softmax)
        if pv is None:
            return None
        qk, scores_info = self._backward_to_qk(softmax.args[0])
        if qk is None:
            return None
        qkv = self._qkv(qk, pv)
        if qkv is None:
            return None
        q, k, v = qkv
        chain = _Chain(q, k, v, anchor=pv, flat=pv.target == aten.bmm.default, **scores_info)
        if chain.alibi_slopes is not None and node_val(q).shape[1] != node_val(chain.alibi_slopes).numel():
            return None
        chain.covered.extend([softmax, *probs_path])
        self._lse_sinks(chain, softmax.args[0], node_val(q).shape[1])
        return chain

    def _forward_to_pv(self, softmax: Node) -> tuple[Node | None, list[Node]]:
        """``probs @ v`` and the nodes between it and the softmax."""
        node, path = softmax, []
        while len(node.users) == 1:
            (user,) = node.users
            if _call(user, *_CASTS, *_RESHAPES, *_NOOPS) or _is_noop_dropout(user):
                node = user
                path.append(node)
                continue
            if _call(user, aten.matmul.default, aten.bmm.default) and user.args[0] is node:
                return user, path
            break
        return None, path

    def _backward_to_qk(self, s: Node):
        info = dict(scale=1.0, masked=False, alibi_slopes=None, covered=[])
        n_heads = None
        while isinstance(s, Node) and s.op == "call_function":
            info["covered"].append(s)
            t, args = s.target, s.args
            if t in _CASTS or t in _NOOPS or t in _RESHAPES:
                s = args[0]
            elif t in (aten.mul.Tensor, aten.div.Tensor):
                lit = _literal(args[1])
                if lit is None and t == aten.mul.Tensor and _literal(args[0]) is not None:
                    lit, args = _literal(args[0]), args[::-1]
                if lit is not None and lit != 0:
                    info["scale"] *= lit if t == aten.mul.Tensor else 1.0 / lit
                    s = args[0]
                elif t == aten.mul.Tensor and (other := self._score_side(args, s)) is not None:
                    shape = _dims(args[1] if args[0] is other else args[0])
                    if shape is None or static_int(shape[-1]) == 1 or static_int(shape[-2]) == 1:
                        return None, info  # a per-row or per-column factor, not a 0/1 mask
                    info["masked"], s = True, other
                else:
                    return None, info
            elif t == aten.add.Tensor:
                for x, y in (args, args[::-1]):
                    if isinstance(y, Node) and not self.param_free(x):
                        break
                else:
                    return None, info
                n_heads = n_heads or self._heads_of(s)
                slopes = self.alibi(y, n_heads) if n_heads else None
                if slopes is not None and info["alibi_slopes"] is None:
                    info["alibi_slopes"] = slopes
                elif self.is_mask(y, s):
                    info["masked"] = True
                else:
                    return None, info
                s = x
            elif t == aten.where.self:
                cond, x, other = args
                if not (self.is_mask(cond, s) and self.param_free(other)) or self.param_free(x):
                    return None, info
                info["masked"], s = True, x
            elif t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
                if not self.is_mask(args[1], s) or self.param_free(args[0]):
                    return None, info
                info["masked"], s = True, args[0]
            elif t in (aten.max.other, aten.maximum.default, aten.clamp_min.default):
                floor = self._scalar(args[1])
                if floor is None or floor > _VERY_NEGATIVE:
                    return None, info
                s = args[0]
            elif t == aten.sub.Tensor and self._is_row_max(args[1], args[0]):
                info["covered"].extend([args[1], args[1].args[0]])
                s = args[0]  # softmax(x - max(x)): the same softmax
            elif t in (aten.matmul.default, aten.bmm.default):
                return s, info
            elif t == aten.baddbmm.default:
                beta, alpha = s.kwargs.get("beta", 1), s.kwargs.get("alpha", 1)
                if len(args) > 3 or beta != 1 or _literal(alpha) is None:
                    return None, info
                info["scale"] *= alpha
                bias = args[0]
                if not _call(bias, aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default):
                    n_heads = self._heads_of_flat(s)
                    slopes = self.alibi(bias, n_heads) if n_heads else None
                    if slopes is None:
                        return None, info
                    info["alibi_slopes"] = slopes
                return s, info
            else:
                return None, info
        return None, info

    @staticmethod
    def _is_row_max(node, x) -> bool:
        """``x.max(-1, keepdim=True).values``."""
        if not (_call(node, operator.getitem) and node.args[1] == 0 and _call(node.args[0], aten.max.dim)):
            return False
        mx = node.args[0]
        return mx.args[0] is x and mx.args[1] in (-1, len(_dims(x) or ()) - 1) and len(mx.args) > 2 and mx.args[2]

    def _scalar(self, node) -> float | None:
        """A literal, ``full([], value)``, or a one-element constant readable now (not on the meta device)."""
        while _call(node, *_NOOPS, *_CASTS):
            node = node.args[0]
        if _call(node, aten.full.default):
            node = node.args[1]
        if isinstance(node, Node) and node.op == "get_attr":
            try:
                value = get_attr_tensor(self.gm, node.target)
            except AttributeError:
                return None
            return float(value) if value.numel() == 1 and value.device.type != "meta" else None
        return _literal(node)

    def _score_side(self, args, node) -> Node | None:
        """Of a product's two operands, the scores (the one computed from parameters), when the other is a
        mask; None otherwise."""
        a, b = args
        for x, y in ((a, b), (b, a)):
            if isinstance(x, Node) and not self.param_free(x) and self.is_mask(y, node):
                return x
        return None

    @staticmethod
    def _heads_of(scores: Node) -> int | None:
        shape = _dims(scores)
        return static_int(shape[1]) if shape is not None and len(shape) == 4 else None

    @staticmethod
    def _heads_of_flat(product: Node) -> int | None:
        """The heads of a [b*h, s, kv] product, from the 4-D reshape of its first operand."""
        src = product.args[1]
        while _call(src, *_CASTS, *_NOOPS):
            src = src.args[0]
        if _call(src, *_RESHAPES):
            shape = _dims(src.args[0])
            return static_int(shape[1]) if shape is not None and len(shape) == 4 else None
        return None

    # -- q, k, v --------------------------------------------------------------------------------
    def _qkv(self, qk: Node, pv: Node):
        """q, k (or ``("transpose", k^T)`` when k^T is no transpose), v in [b, h, s, d]; the scores and the
        output may each be 4-D or 3-D [b*h, ...] (bmm) independently (GPT-NeoX-Japanese mixes them)."""
        a, kt = (qk.args[1], qk.args[2]) if qk.target == aten.baddbmm.default else qk.args[:2]
        v = self._unflatten(pv.args[1]) if pv.target == aten.bmm.default else pv.args[1]
        if qk.target != aten.matmul.default:
            if not _call(kt, aten.transpose.int) or {kt.args[1] % 3, kt.args[2] % 3} != {1, 2}:
                return None
            q, k = self._unflatten(a), self._unflatten(kt.args[0])
        else:
            q = a
            if _call(kt, aten.transpose.int) and {kt.args[1] % 4, kt.args[2] % 4} == {2, 3}:
                k = kt.args[0]
            else:
                k = ("transpose", kt)  # inserted at rewrite time
        k_t = k[1] if isinstance(k, tuple) else k
        if any(_dims(t) is None or len(_dims(t)) != 4 for t in (q, k_t, v)):
            return None
        return q, k, v

    @staticmethod
    def _unflatten(node) -> Node | None:
        """The 4-D [b, h, s, d] tensor a [b*h, s, d] operand was reshaped from."""
        if not _call(node, *_RESHAPES):
            return None
        src = node.args[0]
        shape, flat = _dims(src), _dims(node)
        if shape is None or flat is None or len(shape) != 4 or len(flat) != 3:
            return None
        return src

    def _lse_sinks(self, chain: _Chain, scores: Node, n_heads: int) -> None:
        """``out * sigmoid(logsumexp(scores) - sinks)[..., None]`` after the product: sinks in the softmax."""
        if chain.flat or len(chain.anchor.users) != 1:
            return
        (mul,) = chain.anchor.users
        if not _call(mul, aten.mul.Tensor):
            return
        factor = mul.args[1] if mul.args[0] is chain.anchor else mul.args[0]
        path = []
        node = factor
        while _call(node, aten.unsqueeze.default, *_CASTS):
            path.append(node)
            node = node.args[0]
        if not _call(node, aten.sigmoid.default):
            return
        path.append(node)
        sub = node.args[0]
        while _call(sub, *_CASTS):
            path.append(sub)
            sub = sub.args[0]
        if not _call(sub, aten.sub.Tensor) or not _call(sub.args[0], aten.logsumexp.default):
            return
        lse, sinks = sub.args
        if lse.args[0] is not scores or list(lse.args[1]) not in ([-1], [3]):
            return
        sink_src = sinks
        while _call(sink_src, *_RESHAPES):
            sink_src = sink_src.args[0]
        val = node_val(sink_src)
        if val is None or val.numel() != n_heads:
            return
        chain.covered.extend([chain.anchor, *path, sub, lse, sinks])
        chain.sinks, chain.anchor = sink_src, mul


@TransformRegistry.register("match_attention_chain")
class MatchAttentionChain(BaseTransform):
    """The attention forms ``match_eager_attention``'s patterns miss -> ``torch_attention`` (layout bnsd);
    see the module docstring for the forms."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        config = ctx.text_config()
        walker = _Walker(gm)
        chains = [c for n in list(gm.graph.nodes) if _call(n, *_SOFTMAX) and (c := walker.match(n)) is not None]
        layers = _attention_layers([c.anchor for c in chains])
        for chain, layer in zip(chains, layers):
            k = chain.k
            if isinstance(k, tuple):  # k^T was not a transpose: transpose it back
                with gm.graph.inserting_before(chain.anchor):
                    k = gm.graph.call_function(aten.transpose.int, (k[1], 2, 3))
            new = _insert_attention(gm, chain.anchor, chain.q, k, chain.v, scale=chain.scale,
                                    is_causal=chain.masked, sinks=chain.sinks,
                                    sliding_window=_sliding_window(config, layer))
            if chain.alibi_slopes is not None:
                new.kwargs = {**new.kwargs, "alibi_slopes": chain.alibi_slopes}
            out = new
            if chain.flat:
                with gm.graph.inserting_after(new):
                    out = gm.graph.call_function(aten.flatten.using_ints, (new, 0, 1))
            chain.anchor.replace_all_uses_with(out)
            _erase_unused(gm, [chain.anchor, *chain.covered])
        return gm, TransformInfo.changed(len(chains))


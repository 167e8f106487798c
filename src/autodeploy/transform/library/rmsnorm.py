"""pattern_matcher stage: ``match_rmsnorm_pattern`` rewrites RMS normalizations into
``auto_deploy::torch_rmsnorm(x, weight, eps)``.

What models compute (HF ``LlamaRMSNorm`` and its many copies)::

    x32 = x.to(float32)
    normed = x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)

The patterns are traced with ``torch.export`` (:mod:`autodeploy.utils.pattern`) and matched with
torch.fx's ``SubgraphMatcher``. They start at the fp32 value ``h`` that is normalized and come in two
forms, each with both operand orders of the two multiplies (``h * rsqrt`` / ``rsqrt * h``;
``weight * normed`` / ``normed * weight``):

- **cast**: ``weight * (h * rsqrt(mean(h^2) + eps)).to(out_dtype)``, as a bf16/fp16 model exports it.
  When ``h`` is ``x.to(float32)`` and ``out_dtype`` is ``x``'s dtype, the op gets ``x`` (the upcast
  is left outside the pattern, so a graph that also uses it elsewhere, e.g. for the residual of an
  fp32 model whose no-op casts were not removed, still matches); when ``out_dtype`` is float32 the
  cast is a no-op and the op gets ``h``. Any other cast is not what the op computes: unmatched.
- **plain**: no down-cast (an fp32 graph, where ``cleanup_noop_to`` has removed the no-op casts);
  the op gets ``h``. This form also covers Gemma's ``(x.float() normed) * (1 + weight.float())``
  followed by ``type_as(x)``: ``h`` binds to the fp32 upcast, ``weight`` to the fp32 ``1 + weight``
  node, the op computes the same fp32 products, and the trailing cast stays in the graph.

``h`` must be float32 (from ``node.meta["val"]``): a norm computed in low precision without the
upcast is left alone, since the op would compute it more precisely, i.e. differently.
- **weightless** (NanoChat's norms, Llama 4's L2 q/k norm): either form without the weight multiply, tried
  after the weighted ones; the op gets ``weight=None``.

The literals models vary (eps, the exponent, the dtype cast to) are pattern inputs, checked on every
match (exponent 2, ``eps`` a number, casts as above); the others (mean over dim -1 with keepdim)
must be exactly the pattern's. ``weight`` must be 1-D with ``x``'s last dim (the op's weight), so
the op's output has ``x``'s shape. Norms over ``[b, s, heads, head_dim]`` (Qwen3's q/k norms) match
like any other.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch.fx import GraphModule, Node

from ...utils.fx import node_val
from ...utils.pattern import PatternMatch, find_matches, trace_pattern
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten


def _make_pattern_fn(cast: bool, x_first: bool, weight_first: bool | None):
    """``weight_first`` None: the weightless form (no multiply by a weight)."""

    def pattern(h, *weight):  # h: the fp32 value normalized (x itself, or x.to(float32))
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        normed = h * r if x_first else r * h
        if cast:
            normed = normed.to(torch.bfloat16)  # the dtype is a pattern input (out_dtype)
        if weight_first is None:
            return normed
        return weight[0] * normed if weight_first else normed * weight[0]

    return pattern


def _literal_to_placeholder(gm: GraphModule, node: Node, index: int, name: str) -> None:
    """Make ``node.args[index]`` (a literal) a pattern input, so any value matches and is reported."""
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        placeholder = gm.graph.placeholder(name)
    args = list(node.args)
    args[index] = placeholder
    node.args = tuple(args)


@functools.lru_cache(maxsize=None)
def _patterns() -> list[tuple[bool, GraphModule]]:
    """(cast, pattern graph) for every form; cast forms first (they are the larger ones).

    Literal arguments the models vary (eps, the exponent, the dtype cast back to) are turned into
    pattern inputs ``eps``, ``exponent``, ``out_dtype``: the matcher binds them to the model's values
    and :func:`_check_match` validates them. Every other literal must match exactly.
    """
    patterns = []
    forms = list(itertools.product((True, False), (True, False), (True, False)))
    forms += list(itertools.product((True, False), (True, False), (None,)))  # weightless, after the others
    for cast, x_first, weight_first in forms:
        example = [torch.randn(2, 3, 8), torch.randn(8, dtype=torch.bfloat16 if cast else torch.float32)]
        example = example[:1] if weight_first is None else example
        gm = trace_pattern(_make_pattern_fn(cast, x_first, weight_first), example)
        for placeholder, name in zip(gm.graph.find_nodes(op="placeholder"), ("h", "weight")):
            placeholder._rename(name)  # the names PatternMatch.inputs reports them under
        for node in list(gm.graph.nodes):
            if node.target is aten.add.Tensor:
                _literal_to_placeholder(gm, node, 1, "eps")
            elif node.target is aten.pow.Tensor_Scalar:
                _literal_to_placeholder(gm, node, 1, "exponent")
            elif node.target is aten.to.dtype:
                _literal_to_placeholder(gm, node, 1, "out_dtype")
        gm.graph.lint()
        gm.recompile()
        patterns.append((cast, gm))
    return patterns


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _upcast_source(h: Node) -> Node | None:
    """``x`` if ``h`` is a plain ``x.to(float32)`` (``aten.to.dtype`` / ``aten._to_copy``), else None."""
    if h.op != "call_function" or not h.args or not isinstance(h.args[0], Node):
        return None
    if h.target is aten.to.dtype:
        extra = dict(h.kwargs)
        if len(h.args) > 2 or any(v not in (None, False, torch.preserve_format) for v in extra.values()):
            return None
    elif h.target is aten._to_copy.default:
        if len(h.args) > 1 or h.kwargs.get("layout") not in (None, torch.strided):
            return None
        extra = {k: v for k, v in h.kwargs.items() if k not in ("dtype", "layout", "device")}
        if any(v not in (None, False, torch.preserve_format) for v in extra.values()):
            return None
    else:
        return None
    x_val, h_val = node_val(h.args[0]), node_val(h)
    if x_val is None or h_val is None or x_val.device != h_val.device:
        return None
    return h.args[0]


def _check_match(match: PatternMatch, cast: bool) -> tuple[Node, float] | None:
    """Validate the values bound to the pattern's inputs: -> (x, eps) for the op, or None."""
    h, weight = match.inputs.get("h"), match.inputs.get("weight", None)
    if not isinstance(h, Node) or not isinstance(weight, (Node, type(None))) or len(match.outputs) != 1:
        return None
    h_val = node_val(h)
    if h_val is None or h_val.dim() < 1 or h_val.dtype != torch.float32:
        return None  # a norm computed in low precision: the op would upcast, i.e. compute differently
    hidden = h_val.shape[-1]
    if weight is not None:
        w_val = node_val(weight)
        if w_val is None or w_val.dim() != 1 or not isinstance(hidden, int) or w_val.shape[0] != hidden:
            return None  # the op's weight is [hidden]: its output then has x's shape
    eps, exponent = match.inputs.get("eps"), match.inputs.get("exponent")
    if not _is_number(eps) or not _is_number(exponent) or exponent != 2:
        return None
    x = h
    if cast:  # the normalized fp32 value is cast to out_dtype: the op casts it to x's dtype
        out_dtype = match.inputs.get("out_dtype")
        source = _upcast_source(h)
        if source is not None and node_val(source).dtype == out_dtype:
            x = source  # x.to(float32) ... .to(x.dtype): the HF form in bf16/fp16
        elif out_dtype != torch.float32:
            return None  # cast to a dtype the op cannot express
    return x, float(eps)


def match_rmsnorm(gm: GraphModule) -> int:
    """Rewrite every RMSNorm of ``gm`` into ``torch_rmsnorm``; returns the number of rewrites."""
    num = 0
    for cast, pattern in _patterns():
        for match in find_matches(gm, pattern):
            checked = _check_match(match, cast)
            if checked is None:
                continue
            x, eps = checked
            out = match.outputs[0]
            with gm.graph.inserting_before(out):
                new = gm.graph.call_function(
                    torch.ops.auto_deploy.torch_rmsnorm.default,
                    (x, match.inputs.get("weight"), eps),
                )
            new.meta.update({k: v for k, v in out.meta.items() if k in ("stack_trace", "nn_module_stack")})
            out.replace_all_uses_with(new)
            num += 1
        gm.graph.eliminate_dead_code()  # drop the replaced subgraphs before the next pattern looks
    return num


@TransformRegistry.register("match_rmsnorm_pattern")
class MatchRMSNormPattern(BaseTransform):
    """HF-style RMSNorm subgraphs -> ``auto_deploy::torch_rmsnorm`` (see the module docstring)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        return gm, TransformInfo.changed(match_rmsnorm(gm))


# -- post_load_fusion: fuse_rmsnorm ---------------------------------------------------------------
@TransformRegistry.register("fuse_rmsnorm")
class FuseRMSNorm(BaseTransform):
    """``torch_rmsnorm(x, w, eps)`` -> ``aten.rms_norm(x, [d], w, eps)``: torch's fused kernel, one C++ call
    instead of the op's Python body (docs/performance.md has the per-call times). Only where ``x`` and ``w``
    share a dtype, so the result dtype is unchanged. In float32
    the two are bitwise equal; in bf16/fp16 the fused kernel multiplies by the weight before rounding
    (HF rounds first), which can move results by one unit in the last place."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        count = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.torch_rmsnorm.default)):
            x, weight, eps = node.args[:3]
            x_val = node_val(x)
            w_val = node_val(weight) if weight is not None else None
            if x_val is None or not isinstance(x_val.shape[-1], int):
                continue
            if weight is not None and (w_val is None or x_val.dtype != w_val.dtype or w_val.dim() != 1):
                continue
            with gm.graph.inserting_before(node):
                fused = gm.graph.call_function(aten.rms_norm.default, (x, [x_val.shape[-1]], weight, eps))
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            count += 1
        return gm, TransformInfo.changed(count)

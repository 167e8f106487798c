"""Layer normalization -> ``auto_deploy::torch_layernorm(x, weight?, bias?, eps)``, and its fused form.

pattern_matcher stage, ``match_layernorm_pattern``, two sources:

- **aten**: ``aten.layer_norm`` (``nn.LayerNorm``, ``F.layer_norm``; GPT-2, Phi, Falcon, GPT-NeoX,
  StableLM, StarCoder2, OLMo's non-parametric norm, ...) and ``aten.native_layer_norm`` whose mean/rstd
  outputs are unused, over the last dim only (``normalized_shape == [x.shape[-1]]``), with weight and
  bias None or ``[hidden]`` in ``x``'s dtype (what the op computes is then what aten computes).
- **decomposed** (Cohere's ``CohereLayerNorm`` and hand-written copies), traced like the RMSNorm
  patterns (:mod:`.rmsnorm`) from the fp32 value ``h`` that is normalized::

      mean = h.mean(-1, keepdim=True)
      var = (h - mean).pow(2).mean(-1, keepdim=True)      # h - mean computed once or twice
      normed = (h - mean) * rsqrt(var + eps)
      out = weight * normed [+ bias]  [.to(out_dtype)]    # both operand orders of the multiply

  ``h`` must be float32; with the final cast, ``h = x.to(float32)`` and ``out_dtype == x.dtype`` give
  the op ``x`` (one rounding at the end, as the op does), ``out_dtype`` float32 gives it ``h``; any
  other cast is left alone. ``eps`` and the exponent (2) are pattern inputs checked on every match;
  weight and bias must have the shape of ``x``'s trailing dims (``[hidden]``, or ``[heads, head_dim]``
  for Cohere's q/k norms), so the op's output has ``x``'s shape. The largest forms are tried first;
  the bare ``normed`` (no affine) last.

post_load_fusion stage, ``fuse_layernorm``: ``torch_layernorm`` -> ``aten.layer_norm(x, [d], w, b, eps)``
where weight and bias are None or ``[d]`` in ``x``'s dtype (torch's fused kernel, one C++ call).

Invariants: the graph is clean and every ``node.meta["val"]`` is current after either transform.
"""

from __future__ import annotations

import functools
import itertools
import operator

import torch
from torch.fx import GraphModule, Node

from ...utils.fx import node_val
from ...utils.pattern import PatternMatch, find_matches, trace_pattern
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry
from .rmsnorm import _is_number, _literal_to_placeholder, _upcast_source

aten = torch.ops.aten
LAYERNORM = torch.ops.auto_deploy.torch_layernorm.default


# -- the aten forms -----------------------------------------------------------------------------
def _arg(node: Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _affine_ok(param, x_val) -> bool:
    """None, or a 1-D ``[hidden]`` tensor in ``x``'s dtype."""
    if param is None:
        return True
    val = node_val(param) if isinstance(param, Node) else None
    return val is not None and val.dim() == 1 and val.shape[0] == x_val.shape[-1] and val.dtype == x_val.dtype


def _rewrite_aten(gm: GraphModule) -> int:
    num = 0
    targets = (aten.layer_norm.default, aten.native_layer_norm.default)
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]:
        x, shape = node.args[0], _arg(node, 1, "normalized_shape")
        weight, bias = _arg(node, 2, "weight"), _arg(node, 3, "bias")
        eps = _arg(node, 4, "eps", 1e-5)
        x_val = node_val(x) if isinstance(x, Node) else None
        if x_val is None or x_val.dim() < 1 or not _is_number(eps):
            continue
        if list(shape) != [x_val.shape[-1]] or not isinstance(x_val.shape[-1], int):
            continue
        if not (_affine_ok(weight, x_val) and _affine_ok(bias, x_val)):
            continue
        out = node
        if node.target is aten.native_layer_norm.default:  # (out, mean, rstd): only out may be used
            users = list(node.users)
            if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
                continue
            out = users[0]
        with gm.graph.inserting_before(out):
            new = gm.graph.call_function(LAYERNORM, (x, weight, bias, float(eps)))
        new.meta.update({k: v for k, v in out.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
        out.replace_all_uses_with(new)
        num += 1
    gm.graph.eliminate_dead_code()
    return num


# -- the decomposed form ----------------------------------------------------------------------------
def _make_pattern_fn(shared_sub: bool, affine: str, weight_first: bool, cast: bool):
    def pattern(h, *params):
        mean = h.mean(-1, keepdim=True)
        if shared_sub:
            centered = h - mean
            normed = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5)
        else:
            var = (h - mean).pow(2).mean(-1, keepdim=True)
            normed = (h - mean) * torch.rsqrt(var + 1e-5)
        out = normed
        if affine != "none":
            out = params[0] * normed if weight_first else normed * params[0]
        if affine == "weight_bias":
            out = out + params[1]
        if cast:
            out = out.to(torch.bfloat16)  # the dtype is a pattern input (out_dtype)
        return out

    return pattern


_AFFINE = {"weight_bias": ("weight", "bias"), "weight": ("weight",), "none": ()}


@functools.lru_cache(maxsize=None)
def _patterns() -> list[tuple[bool, GraphModule]]:
    """(cast, pattern graph) for every form, the largest first; eps/exponent/out_dtype are pattern inputs."""
    patterns = []
    for affine, cast, shared_sub, weight_first in itertools.product(_AFFINE, (True, False), (True, False),
                                                                    (True, False)):
        if affine == "none" and not weight_first:
            continue  # no multiply to commute
        names = ("h", *_AFFINE[affine])
        example = [torch.randn(2, 3, 8)] + [torch.randn(8) for _ in names[1:]]
        gm = trace_pattern(_make_pattern_fn(shared_sub, affine, weight_first, cast), example)
        for placeholder, name in zip(gm.graph.find_nodes(op="placeholder"), names):
            placeholder._rename(name)
        for node in list(gm.graph.nodes):
            if node.target is aten.add.Tensor and not isinstance(node.args[1], Node):
                _literal_to_placeholder(gm, node, 1, "eps")
            elif node.target is aten.pow.Tensor_Scalar:
                _literal_to_placeholder(gm, node, 1, "exponent")
            elif node.target is aten.to.dtype:
                _literal_to_placeholder(gm, node, 1, "out_dtype")
        gm.graph.lint()
        gm.recompile()
        patterns.append((cast, gm))
    return patterns


def _param_ok(param, h_val) -> bool:
    """None, or a tensor with the shape of ``h``'s trailing dims (the op's output then has x's shape)."""
    if param is None:
        return True
    val = node_val(param) if isinstance(param, Node) else None
    if val is None or val.dim() < 1 or val.dim() > h_val.dim():
        return False
    return all(isinstance(a, int) and a == b for a, b in zip(val.shape, h_val.shape[-val.dim():]))


def _check_match(match: PatternMatch, cast: bool) -> tuple[Node, Node | None, Node | None, float] | None:
    """Validate the values bound to the pattern's inputs: -> (x, weight, bias, eps) for the op, or None."""
    h = match.inputs.get("h")
    if not isinstance(h, Node) or len(match.outputs) != 1:
        return None
    h_val = node_val(h)
    if h_val is None or h_val.dim() < 1 or h_val.dtype != torch.float32 or not isinstance(h_val.shape[-1], int):
        return None  # a norm computed in low precision: the op would upcast, i.e. compute differently
    weight, bias = match.inputs.get("weight"), match.inputs.get("bias")
    if not (_param_ok(weight, h_val) and _param_ok(bias, h_val)):
        return None
    eps, exponent = match.inputs.get("eps"), match.inputs.get("exponent")
    if not _is_number(eps) or not _is_number(exponent) or exponent != 2:
        return None
    x = h
    if cast:
        out_dtype = match.inputs.get("out_dtype")
        source = _upcast_source(h)
        if source is not None and node_val(source).dtype == out_dtype:
            x = source  # x.to(float32) ... .to(x.dtype)
        elif out_dtype != torch.float32:
            return None
    return x, weight, bias, float(eps)


def _rewrite_decomposed(gm: GraphModule) -> int:
    if not gm.graph.find_nodes(op="call_function", target=aten.mean.dim):
        return 0  # every form starts with a mean over the last dim: no patterns to trace (0.6 s a build)
    num = 0
    for cast, pattern in _patterns():
        for match in find_matches(gm, pattern):
            checked = _check_match(match, cast)
            if checked is None:
                continue
            out = match.outputs[0]
            with gm.graph.inserting_before(out):
                new = gm.graph.call_function(LAYERNORM, checked)
            new.meta.update({k: v for k, v in out.meta.items() if k in ("stack_trace", "nn_module_stack")})
            out.replace_all_uses_with(new)
            num += 1
        gm.graph.eliminate_dead_code()  # drop the replaced subgraphs before the next pattern looks
    return num


def match_layernorm(gm: GraphModule) -> int:
    """Rewrite every LayerNorm of ``gm`` into ``torch_layernorm``; returns the number of rewrites."""
    return _rewrite_aten(gm) + _rewrite_decomposed(gm)


@TransformRegistry.register("match_layernorm_pattern")
class MatchLayerNormPattern(BaseTransform):
    """``aten.layer_norm`` and decomposed LayerNorms -> ``auto_deploy::torch_layernorm`` (module docstring)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        return gm, TransformInfo.changed(match_layernorm(gm))


# -- post_load_fusion: fuse_layernorm ---------------------------------------------------------------
@TransformRegistry.register("fuse_layernorm")
class FuseLayerNorm(BaseTransform):
    """``torch_layernorm(x, w, b, eps)`` -> ``aten.layer_norm(x, [d], w, b, eps)``: torch's fused kernel,
    where w and b are None or ``[d]`` in x's dtype (the result dtype is then unchanged). In float32 the two
    agree to rounding (the fused kernel's variance is computed another way)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        count = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=LAYERNORM)):
            x, weight, bias, eps = node.args[:4]
            x_val = node_val(x)
            if x_val is None or not isinstance(x_val.shape[-1], int):
                continue
            if not (_affine_ok(weight, x_val) and _affine_ok(bias, x_val)):
                continue
            with gm.graph.inserting_before(node):
                fused = gm.graph.call_function(aten.layer_norm.default, (x, [x_val.shape[-1]], weight, bias, eps))
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            count += 1
        return gm, TransformInfo.changed(count)

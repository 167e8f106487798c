"""post_load_fusion stage: ``native_pointwise``, the float32 pointwise work between products onto native kernels.

Three rewrites, each where every tensor involved is float32 (:mod:`autodeploy.custom_ops.pointwise` has the
ops and why):

- ``torch_rmsnorm(x, w, eps)`` -> ``auto_deploy::rms_norm(x, w, eps)`` (``w`` a 1-D weight of x's last dim, or
  none): before ``fuse_rmsnorm``, which takes the norms left over; where ``x`` is a residual add ``a + b`` (one
  shape), the add and the norm become one ``auto_deploy::add_rms_norm(a, b, w, eps)``, whose first output is the
  sum the add's other users read;
- ``silu(gate) * up`` (either order, one shape) -> ``auto_deploy::silu_mul(gate, up)``;
- ``torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)`` (the canonical [batch, seq, heads, head_dim] layout,
  rotate_half pairs, 4-D q and k, 3-D cos and sin) -> ``auto_deploy::rope(q, k, cos, sin)``.

Skipped, with the reason logged, where the native kernels do not run; a graph with none of these (bf16) skips
it without building them. The decode step's compiled graph reads the ops as their plain-torch forms.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from ...custom_ops import native
from ...utils.fx import is_call, node_val
from ...utils.logger import ad_logger
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten
_RMSNORM = torch.ops.auto_deploy.torch_rmsnorm.default
_ROPE = torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default


def _float32(*nodes: object) -> bool:
    vals = [node_val(n) for n in nodes]
    return all(v is not None and v.dtype == torch.float32 and v.device.type == "cpu" for v in vals)


def _rmsnorm(node: Node) -> tuple | None:
    x, weight, eps = node.args[:3]
    if not _float32(x) or (weight is not None and not _float32(weight)):
        return None
    if weight is not None and (node_val(weight).dim() != 1 or node_val(weight).shape[0] != node_val(x).shape[-1]):
        return None
    return torch.ops.auto_deploy.rms_norm.default, (x, weight, eps)


def _silu_mul(node: Node) -> tuple | None:
    if len(node.args) != 2 or node.kwargs:
        return None
    for silu, up in (node.args, node.args[::-1]):
        if is_call(silu, aten.silu.default) and isinstance(up, Node) and _float32(silu.args[0], up, node):
            if node_val(silu.args[0]).shape == node_val(up).shape:
                return torch.ops.auto_deploy.silu_mul.default, (silu.args[0], up)
    return None


def _rope(node: Node) -> tuple | None:
    q, k, cos, sin, *rest = node.args
    options = dict(zip(("unsqueeze_dim", "interleaved"), rest)) | node.kwargs
    if options.get("unsqueeze_dim", 1) != 2 or options.get("interleaved", False) or not _float32(q, k, cos, sin):
        return None
    if node_val(q).dim() != 4 or node_val(k).dim() != 4 or node_val(cos).dim() != 3 or node_val(sin).dim() != 3:
        return None
    return torch.ops.auto_deploy.rope.default, (q, k, cos, sin)


def _fold_residual_adds(gm: GraphModule) -> int:
    """``rms_norm(a + b, w, eps)`` -> ``add_rms_norm(a, b, w, eps)`` (the sum its first output, for the add's
    other users); returns how many."""
    folded, order = 0, {node: i for i, node in enumerate(gm.graph.nodes)}
    for norm in list(gm.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.rms_norm.default)):
        add, weight, eps = norm.args
        if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs or not _float32(*add.args, add):
            continue
        a, b = add.args
        if not (isinstance(a, Node) and isinstance(b, Node) and node_val(a).shape == node_val(b).shape):
            continue
        if weight is not None and order[weight] > order[add]:  # the fused node goes where the add is
            continue
        with gm.graph.inserting_after(add):  # the add's other users may come before the norm
            fused = gm.graph.call_function(torch.ops.auto_deploy.add_rms_norm.default, (a, b, weight, eps))
        with gm.graph.inserting_after(fused):
            total = gm.graph.call_function(operator.getitem, (fused, 0))
            normed = gm.graph.call_function(operator.getitem, (fused, 1))
        fused.meta["val"] = (add.meta.get("val"), norm.meta.get("val"))
        total.meta["val"], normed.meta["val"] = add.meta.get("val"), norm.meta.get("val")
        norm.replace_all_uses_with(normed)
        add.replace_all_uses_with(total)
        gm.graph.erase_node(norm)
        gm.graph.erase_node(add)
        folded += 1
    return folded


#: the node target each rewrite looks at, and what it makes of a node (None: not taken)
_REWRITES: dict[object, tuple[str, Callable[[Node], tuple | None]]] = {
    _RMSNORM: ("rms_norm", _rmsnorm), aten.mul.Tensor: ("silu_mul", _silu_mul), _ROPE: ("rope", _rope)}


@TransformRegistry.register("native_pointwise")
class NativePointwise(BaseTransform):
    """float32 RMSNorm (with the residual add before it), SiLU x up and RoPE -> ``auto_deploy::rms_norm`` /
    ``add_rms_norm`` / ``silu_mul`` / ``rope`` (see the module docstring)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        taken = [node for node in gm.graph.nodes if node.op == "call_function" and node.target in _REWRITES
                 and _REWRITES[node.target][1](node) is not None]
        # checked after the graph: a model with none of these (bf16) never builds the kernels
        if not taken:
            return gm, TransformInfo.unchanged()
        if not native.pointwise_available():
            ad_logger.info("skipped: the native kernels do not run here (see the native kernels' log line)")
            return gm, TransformInfo.unchanged()
        counts: dict[str, int] = {}
        for node in taken:
            # read the node again: its inputs may be nodes replaced a moment ago (Qwen3's q/k norms before RoPE)
            name, rewrite = _REWRITES[node.target]
            target, args = rewrite(node)
            with gm.graph.inserting_before(node):
                fused = gm.graph.call_function(target, args)
            fused.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            counts[name] = counts.get(name, 0) + 1
        counts["add_rms_norm"] = _fold_residual_adds(gm)
        counts["rms_norm"] = counts.get("rms_norm", 0) - counts["add_rms_norm"]
        for silu in list(gm.graph.find_nodes(op="call_function", target=aten.silu.default)):
            if not silu.users:  # its product now reads the gate itself
                gm.graph.erase_node(silu)
        gm.recompile()
        ad_logger.info("native kernels: " + ", ".join(f"{count} {name}" for name, count in counts.items() if count))
        return gm, TransformInfo.changed(len(taken), shapes_current=True)

"""post_export stage: low-level clean-ups of the exported graph.

- ``cleanup_noop_slice``: slices that keep the whole tensor (step 1, output shape == input shape).
- ``cleanup_noop_add``: additions of zeros that change neither shape nor dtype.
- ``cleanup_noop_to``: dtype/device conversions to the dtype and device the tensor already has.
- ``cleanup_input_constraints``: export's runtime assertion and shape-constraint nodes.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..interface import BaseTransform, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same_tensor_type(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same shape (symbolically) and dtype; False when either is unknown."""
    if a is None or b is None or a.dtype != b.dtype or a.dim() != b.dim():
        return False
    return all(_dims_equal(x, y) for x, y in zip(a.shape, b.shape))


def _dims_equal(x, y) -> bool:
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    try:
        return bool(torch.sym_eq(x, y)) if not isinstance(x, int) or not isinstance(y, int) else x == y
    except Exception:  # noqa: BLE001 - an undecidable symbolic comparison means "not provably equal"
        return str(x) == str(y)


def _replace_with_input(gm: GraphModule, node: Node, replacement: Node) -> None:
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)


def _info(num: int) -> TransformInfo:
    # Replacing a node by its equal-typed input keeps every node.meta["val"] valid.
    return TransformInfo(skipped=False, num_matches=num, is_clean=num == 0, has_valid_shapes=True)


@TransformRegistry.register("cleanup_noop_slice")
class CleanupNoopSlice(BaseTransform):
    """Remove ``aten.slice`` nodes that return their input unchanged."""

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.slice.Tensor)):
            source = node.args[0]
            step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
            if step == 1 and _same_tensor_type(_val(source), _val(node)):
                _replace_with_input(gm, node, source)
                num += 1
        return gm, _info(num)


def _is_zero(arg) -> bool:
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return arg == 0
    if not isinstance(arg, Node) or arg.op != "call_function":
        return False
    if arg.target in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default):
        return True
    if arg.target in (aten.full.default, aten.full_like.default, aten.new_full.default):
        fill = arg.args[1] if arg.target != aten.new_full.default else arg.args[2]
        return isinstance(fill, (int, float)) and fill == 0
    return False


@TransformRegistry.register("cleanup_noop_add")
class CleanupNoopAdd(BaseTransform):
    """Remove ``x + 0`` (a zero scalar or a zeros tensor) when it changes neither shape nor dtype."""

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)):
            if node.kwargs.get("alpha", 1) != 1:
                continue
            lhs, rhs = node.args[0], node.args[1]
            for zero, other in ((rhs, lhs), (lhs, rhs)):
                if isinstance(other, Node) and _is_zero(zero) and _same_tensor_type(_val(other), _val(node)):
                    _replace_with_input(gm, node, other)
                    num += 1
                    break
        return gm, _info(num)


_CONVERSION_OPS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default)


@TransformRegistry.register("cleanup_noop_to")
class CleanupNoopTo(BaseTransform):
    """Remove ``x.to(dtype/device)`` nodes that convert to what ``x`` already is.

    HF models cast to fp32 explicitly (e.g. in RMSNorm); in an fp32 model such casts are no-ops that
    export keeps, and because ``x.to(x.dtype)`` returns ``x`` itself, later uses of ``x`` (residual
    adds) refer to the cast node. Removing them gives every dtype one graph shape for the matchers.
    """

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in _CONVERSION_OPS:
                continue
            source, out = node.args[0], _val(node)
            src_val = _val(source)
            if src_val is None or out is None or node.kwargs.get("memory_format") not in (None, torch.preserve_format):
                continue
            if src_val.device == out.device and _same_tensor_type(src_val, out):
                _replace_with_input(gm, node, source)
                num += 1
        return gm, _info(num)


# Nodes export inserts to check shapes/values at run time; they compute nothing the model needs.
_CONSTRAINT_OPS = {
    aten._assert_scalar.default,
    aten._assert_tensor_metadata.default,
    aten.sym_constrain_range.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_async.default,
    aten._assert_async.msg,
    aten._functional_assert_async.msg,
}


def _is_constraint(gm: GraphModule, node: Node) -> bool:
    if node.users:
        return False
    if node.op == "call_function":
        return node.target in _CONSTRAINT_OPS
    # export's input-guard check (torch.export._unlift.GuardsFn), called first thing in forward
    return node.op == "call_module" and type(gm.get_submodule(node.target)).__name__ == "GuardsFn"


@TransformRegistry.register("cleanup_input_constraints")
class CleanupInputConstraints(BaseTransform):
    """Remove export's assertion, input-guard and shape-constraint nodes."""

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.nodes):
            if _is_constraint(gm, node):
                gm.graph.erase_node(node)
                num += 1
        return gm, _info(num)

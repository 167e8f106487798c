"""Clean-up transforms: rewrites that remove what computes nothing.

post_export stage, on the exported graph:

- ``cleanup_noop_slice``: slices that keep the whole tensor (step 1, output shape == input shape).
- ``cleanup_noop_add``: additions of zeros that change neither shape nor dtype.
- ``cleanup_noop_to``: dtype/device conversions to the dtype and device the tensor already has.
- ``cleanup_input_constraints``: export's runtime assertion and shape-constraint nodes.
- ``cleanup_slice_writes``: a fresh buffer filled by in-place copies into slices that tile one dim (HF's MLA
  ``key = new_empty(...); key[..., :nope].copy_(k_nope); key[..., nope:].copy_(k_rot)``) -> ``cat`` of the
  copied values: the graph stays functional, and the matchers see what the buffer holds.

pattern_matcher stage, after the attention layout is canonical:

- ``eliminate_redundant_transposes``: ``x.transpose(a, b)[.reshape(same shape)].transpose(a, b)`` -> ``x``.

Replacing a node by an input of the same type keeps every ``node.meta["val"]`` current, so these report
current shapes after a rewrite.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ...utils.fx import node_val, same_shape, same_tensor_type
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten


def _replace_with_input(gm: GraphModule, node: Node, replacement: Node) -> None:
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)


def _info(num: int) -> TransformInfo:
    return TransformInfo.changed(num, shapes_current=True)


@TransformRegistry.register("cleanup_noop_slice")
class CleanupNoopSlice(BaseTransform):
    """Remove ``aten.slice`` nodes that return their input unchanged."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.slice.Tensor)):
            source = node.args[0]
            step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
            if step == 1 and same_tensor_type(node_val(source), node_val(node)):
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

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)):
            if node.kwargs.get("alpha", 1) != 1:
                continue
            lhs, rhs = node.args[0], node.args[1]
            for zero, other in ((rhs, lhs), (lhs, rhs)):
                if isinstance(other, Node) and _is_zero(zero) and same_tensor_type(node_val(other), node_val(node)):
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

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in _CONVERSION_OPS:
                continue
            source, out = node.args[0], node_val(node)
            src_val = node_val(source)
            if src_val is None or out is None or node.kwargs.get("memory_format") not in (None, torch.preserve_format):
                continue
            if src_val.device == out.device and same_tensor_type(src_val, out):
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

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.nodes):
            if _is_constraint(gm, node):
                gm.graph.erase_node(node)
                num += 1
        return gm, _info(num)


_FRESH_BUFFERS = (aten.new_empty.default, aten.empty.memory_format, aten.empty_like.default)


def _slice_write(sl: Node, ndim: int) -> tuple[int, int, int | None, Node] | None:
    """(dim, start, end, copy_ node) of ``buf[start:end]`` (step 1, on ``dim``) written by one ``copy_`` of a value
    of its own shape and dtype (no broadcast, no cast) whose result is unused; None otherwise."""
    dim, start, end = (list(sl.args[1:4]) + [0, 0, None])[:3]
    step = sl.args[4] if len(sl.args) > 4 else 1
    if step != 1 or not isinstance(dim, int) or not isinstance(start, int) or not isinstance(end, (int, type(None))):
        return None
    copy = next(iter(sl.users)) if len(sl.users) == 1 else None
    if copy is None or copy.target != aten.copy_.default or copy.args[0] is not sl or copy.users:
        return None
    value = copy.args[1]
    if not isinstance(value, Node) or not same_tensor_type(node_val(value), node_val(sl)):
        return None
    return dim % ndim, start, end, copy


def _tiling_writes(buf: Node, pos: dict[Node, int]) -> tuple[int, list[Node], list[Node]] | None:
    """(dim, the copy_ nodes in slice order, the slices) when ``buf``'s slices tile one static dim of it, each
    written by its ``copy_``, and every other use of ``buf`` comes after the last copy."""
    buf_val = node_val(buf)
    slices = [u for u in buf.users if u.op == "call_function" and u.target == aten.slice.Tensor]
    if buf_val is None or not slices:
        return None
    writes = [_slice_write(sl, buf_val.dim()) for sl in slices]
    if any(w is None for w in writes) or len({w[0] for w in writes}) != 1:
        return None
    dim = writes[0][0]
    size = buf_val.shape[dim]
    if not isinstance(size, int):
        return None
    writes.sort(key=lambda w: w[1])
    edge = 0
    for _, start, end, _ in writes:
        if start != edge:
            return None
        edge = size if end is None else min(end, size)
    if edge != size:
        return None
    copies = [w[3] for w in writes]
    last = max(pos[c] for c in copies)
    if any(pos[u] < last for u in buf.users if u not in slices):
        return None
    return dim, copies, slices


@TransformRegistry.register("cleanup_slice_writes")
class CleanupSliceWrites(BaseTransform):
    """A fresh buffer whose slices along one dim are each filled by a ``copy_`` -> ``cat`` of the copied values."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        for buf in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _FRESH_BUFFERS]:
            found = _tiling_writes(buf, pos)
            if found is None:
                continue
            dim, copies, slices = found
            last = max(copies, key=pos.__getitem__)
            with gm.graph.inserting_after(last):
                cat = gm.graph.call_function(aten.cat.default, ([c.args[1] for c in copies], dim))
            cat.meta["val"] = buf.meta.get("val")
            buf.replace_all_uses_with(cat, delete_user_cb=lambda user, slices=slices: user not in slices)
            for node in (*copies, *slices, buf):
                gm.graph.erase_node(node)
            num += 1
        return gm, _info(num)


_RESHAPES = [aten.reshape.default, aten.view.default, aten._unsafe_view.default]

def _norm_dims(node: Node) -> tuple[int, int] | None:
    val = node_val(node.args[0])
    d0, d1 = node.args[1], node.args[2]
    if val is None or not isinstance(d0, int) or not isinstance(d1, int):
        return None
    rank = val.dim()
    return tuple(sorted((d0 % rank, d1 % rank)))


@TransformRegistry.register("eliminate_redundant_transposes")
class EliminateRedundantTransposes(BaseTransform):
    """``x.transpose(a, b).transpose(a, b)`` -> ``x``, also across shape-preserving reshape/view nodes
    between the two (``x.transpose(a, b).reshape(same shape).transpose(a, b)``). The result has the
    values and the strides of ``x``, i.e. of the double transpose."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.transpose.int)):
            dims = _norm_dims(node)
            if dims is None:
                continue
            inner = node.args[0]
            while (isinstance(inner, Node) and inner.op == "call_function" and inner.target in _RESHAPES
                   and same_shape(node_val(inner.args[0]), node_val(inner))):
                inner = inner.args[0]
            if not (isinstance(inner, Node) and inner.op == "call_function" and inner.target == aten.transpose.int):
                continue
            if _norm_dims(inner) != dims:
                continue
            source = inner.args[0]
            if not same_shape(node_val(source), node_val(node)):
                continue
            node.replace_all_uses_with(source)
            num += 1
        return gm, TransformInfo.changed(num, shapes_current=True)

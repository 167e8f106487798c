"""pattern_matcher stage: ``match_moe_pattern`` rewrites the traced expert loop of each MoE block into
``auto_deploy::torch_moe(x, selected_experts, routing_weights, gate_up_weight, down_weight)``.

What the export patch ``moe_dense_experts`` (:mod:`autodeploy.export.patches.moe`) traces, per block
(after ``moe_expand`` has rebuilt any untraced experts)::

    routing = scatter_add(zeros([T, E(+1)]), 1, clamp(top_k_index, max=E), top_k_weights)
    for e in range(E):                                    # unrolled
        h   = linear(x, select(gate_up_proj, 0, e))       # [T, 2I]
        g,u = chunk(h, 2, -1)
        h   = linear(silu(g) * u, select(down_proj, 0, e))  # [T, H]
        contribution_e = h * unsqueeze(select(routing, 1, e), 1)[.to(h.dtype)]
    out = (zeros_like(x) +) contribution_0 + contribution_1 + ...

The match is structural, anchored on the routing ``scatter_add`` (its base must be zeros), and
checks what each node computes, expert by expert:

- every column select ``select(routing, 1, e)`` reaches a multiply (through ``unsqueeze`` and at most
  one cast, which must be to ``h``'s dtype; without a cast the routing dtype must be ``h``'s);
- ``h`` is the SwiGLU chain above: bias-free ``aten.linear`` on ``select(<3D weight>, 0, e)`` (not a
  transposed weight), ``chunk(2, -1)`` or an equal ``split``, ``silu`` of the first half times the
  second half, one ``x`` for all experts; ``gate_up`` is ``[E, 2I, H]`` (or holds more experts' rows, of
  which the op gets the first E: LongCat-Flash's zero-computation experts) and ``down`` ``[E, H, I]``;
- the expert index of the weights equals the routing column, each of the ``E`` experts occurs
  once, and the routing matrix has ``E`` or ``E + 1`` columns (the extra one collects the
  expert-parallel sentinel ids);
- the contributions are summed by a tree of ``aten.add`` (zeros allowed as leaves: the loop's
  initial ``zeros_like``) whose inner nodes feed nothing else, and the sum has ``x``'s dtype.

Anything else (biases, transposed weights, another activation, a post-expert norm, a missing
expert) leaves the block unmatched; it is not counted. The router (softmax/top-k/normalization) and
shared experts stay in the graph as they are; the op gets the router's top-k ids (before the clamp:
the op ignores ids >= E itself) and weights.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from ...custom_ops.linear import LINEAR
from ...utils.fx import is_call, node_val, same_shape, sizes_equal
from ...utils.logger import ad_logger
from ...utils.products import product_of
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten

_ZEROS = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
_FULLS = (aten.full.default, aten.full_like.default, aten.new_full.default)
_CASTS = (aten.to.dtype, aten._to_copy.default)
_getitem = operator.getitem


def _is_zeros(node) -> bool:
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    if node.target in _ZEROS:
        return True
    if node.target in _FULLS:
        fill = node.args[2] if node.target is aten.new_full.default else node.args[1]
        return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill == 0
    return False


def _single_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _normalized_dim(dim, ndim: int):
    return dim + ndim if isinstance(dim, int) and dim < 0 else dim


@dataclass
class _Expert:
    index: int
    x: Node
    gate_up: Node  # the [E, 2I, H] weight the expert's select reads
    down: Node  # the [E, H, I] weight


def _linear_weight_select(node) -> tuple[Node, Node, int] | None:
    """``linear(input, select(W, 0, e))`` without bias -> (input, W, e)."""
    product = product_of(node)
    if product is None or product.kind is not LINEAR or product.bias is not None:
        return None
    inp, weight = product.input, product.weight
    if not is_call(weight, aten.select.int) or len(weight.args) != 3 or weight.kwargs:
        return None
    source, dim, index = weight.args
    w_val = node_val(source)
    if not isinstance(source, Node) or dim != 0 or not isinstance(index, int) or w_val is None or w_val.dim() != 3:
        return None
    return inp, source, index


def _gate_halves(node) -> tuple[Node, Node] | None:
    """``silu(gate) * up`` (either order) with gate/up the two halves of one tensor -> (gate, up)."""
    if not is_call(node, aten.mul.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    for silu, up in (node.args, node.args[::-1]):
        if is_call(silu, aten.silu.default) and isinstance(up, Node):
            halves = _split_halves(silu.args[0], up)
            if halves is not None:
                return halves
    return None


def _split_halves(gate, up) -> tuple[Node, Node] | None:
    """(gate, up) are ``getitem(chunk(h, 2, -1), 0)`` and ``getitem(..., 1)`` (or a 2-way split): -> (h, h)."""
    if not (isinstance(gate, Node) and isinstance(up, Node)):
        return None
    if (
        gate.op != "call_function" or up.op != "call_function"
        or gate.target is not _getitem or up.target is not _getitem
    ):
        return None
    if gate.args[0] is not up.args[0] or gate.args[1] != 0 or up.args[1] != 1:
        return None
    split = gate.args[0]
    h_val = node_val(split.args[0]) if isinstance(split, Node) and split.args else None
    if h_val is None or split.op != "call_function":
        return None
    last = h_val.dim() - 1
    if split.target is aten.chunk.default:
        chunks = split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if chunks != 2 or _normalized_dim(dim, h_val.dim()) != last:
            return None
    elif split.target is aten.split.Tensor:
        size = split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        width = h_val.shape[-1]
        if _normalized_dim(dim, h_val.dim()) != last or not isinstance(width, int) or size * 2 != width:
            return None
    else:
        return None
    return split.args[0], split.args[0]


def _expert_output(h) -> _Expert | None:
    """The SwiGLU expert chain ending in ``h`` -> its expert index, input and weights."""
    down = _linear_weight_select(h)
    if down is None:
        return None
    act, down_weight, index = down
    halves = _gate_halves(act)
    if halves is None:
        return None
    up = _linear_weight_select(halves[0])
    if up is None:
        return None
    x, gate_up_weight, up_index = up
    if up_index != index or not isinstance(x, Node):
        return None
    return _Expert(index, x, gate_up_weight, down_weight)


def _column_contribution(select: Node) -> tuple[int, Node, Node] | None:
    """From ``select(routing, 1, e)`` to ``h * column``: -> (e, contribution mul, h)."""
    index = select.args[2]
    node = _single_user(select)
    if not is_call(node, aten.unsqueeze.default) or _normalized_dim(node.args[1], 2) != 1:
        return None
    column = node
    node = _single_user(column)
    cast = None
    if isinstance(node, Node) and node.op == "call_function" and node.target in _CASTS:
        cast, column = node, node
        node = _single_user(column)
    if not is_call(node, aten.mul.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    h = node.args[0] if node.args[1] is column else node.args[1]
    if h is column or not isinstance(h, Node):
        return None
    h_val, col_val = node_val(h), node_val(column)
    if h_val is None or col_val is None or col_val.dtype != h_val.dtype:
        return None  # the loop multiplies in h's dtype (``.to(h.dtype)``); a promoting mul is another computation
    if cast is not None and (len(cast.args) > 2 or any(k not in ("dtype", "layout", "device") for k in cast.kwargs)):
        return None
    return index, node, h


def _sum_root(contributions: list[Node], position: dict[Node, int]) -> Node | None:
    """The root of the ``aten.add`` tree that sums exactly ``contributions`` (zeros allowed as leaves)."""
    if len(contributions) == 1 and not any(is_call(u, aten.add.Tensor) for u in contributions[0].users):
        return contributions[0]
    members = set(contributions)
    adds: list[Node] = []
    node = min(contributions, key=position.__getitem__)
    while node is not None and node.op != "output":
        if (
            is_call(node, aten.add.Tensor)
            and len(node.args) == 2
            and not node.kwargs
            and all(isinstance(a, Node) and (a in members or _is_zeros(a)) for a in node.args)
            and any(a in members for a in node.args)
        ):
            members.add(node)
            adds.append(node)
        node = node.next
    if not adds:
        return None
    roots = [a for a in adds if not any(u in members for u in a.users)]
    if len(roots) != 1:
        return None
    root = roots[0]
    for member in members:
        if member is root:
            continue
        user = _single_user(member)
        if user is None or user not in members or list(user.args).count(member) != 1:
            return None  # a partial sum used elsewhere, or a contribution counted twice
    return root


def _routing_matrices(gm: GraphModule) -> list[Node]:
    """``scatter_add(zeros([T, C]), 1, index, weights)`` nodes."""
    found = []
    for node in gm.graph.find_nodes(op="call_function", target=aten.scatter_add.default):
        base, dim = node.args[0], node.args[1]
        val = node_val(node)
        if val is None or val.dim() != 2 or _normalized_dim(dim, 2) != 1 or not _is_zeros(base):
            continue
        found.append(node)
    return found


def _match_block(routing: Node, position: dict[Node, int]) -> tuple[Node, tuple[Node, Node, Node, Node, Node]] | None:
    """-> (sum root, torch_moe args) for the expert loop reading ``routing``, or None."""
    index, weights = routing.args[2], routing.args[3]
    columns = node_val(routing).shape[1]
    if not isinstance(columns, int) or not isinstance(index, Node) or not isinstance(weights, Node):
        return None
    experts: dict[int, _Expert] = {}
    contributions: list[Node] = []
    for select in routing.users:
        if not is_call(select, aten.select.int) or select.args[0] is not routing:
            continue
        if _normalized_dim(select.args[1], 2) != 1 or not isinstance(select.args[2], int):
            continue
        found = _column_contribution(select)
        if found is None:
            return None
        column, contribution, h = found
        expert = _expert_output(h)
        if expert is None or expert.index != column or column in experts:
            return None
        experts[column] = expert
        contributions.append(contribution)
    if not experts:
        return None

    first = next(iter(experts.values()))
    x, gate_up, down = first.x, first.gate_up, first.down
    if any(e.x is not x or e.gate_up is not gate_up or e.down is not down for e in experts.values()):
        return None
    gu_val, dn_val, x_val, idx_val, w_val = (
        node_val(gate_up), node_val(down), node_val(x), node_val(index), node_val(weights)
    )
    if None in (gu_val, dn_val, x_val, idx_val, w_val) or x_val.dim() != 2:
        return None
    num_experts, hidden, inter = dn_val.shape
    # gate_up may hold rows for more experts than down (LongCat-Flash lays it out for its zero-computation
    # experts too, which the loop never reads): the op gets its first E
    if (not isinstance(gu_val.shape[0], int) or gu_val.shape[0] < num_experts
            or tuple(gu_val.shape[1:]) != (2 * inter, hidden) or not sizes_equal(x_val.shape[1], hidden)):
        return None  # not the fused [E, 2I, H] gate_up / [E, H, I] down layout
    if sorted(experts) != list(range(num_experts)) or columns not in (num_experts, num_experts + 1):
        return None  # every expert exactly once, routing column e for expert e
    if idx_val.dim() != 2 or idx_val.dtype != torch.int64 or not same_shape(idx_val, w_val):
        return None
    if not sizes_equal(node_val(routing).shape[0], x_val.shape[0]) or not sizes_equal(idx_val.shape[0], x_val.shape[0]):
        return None

    root = _sum_root(contributions, position)
    root_val = node_val(root) if root is not None else None
    if root_val is None or root_val.dtype != x_val.dtype or not same_shape(root_val, x_val):
        return None

    # the router's ids before the clamp that only redirects sentinel ids to the unused extra column
    if is_call(index, aten.clamp.default) and columns == num_experts + 1:
        lo = index.args[1] if len(index.args) > 1 else index.kwargs.get("min")
        hi = index.args[2] if len(index.args) > 2 else index.kwargs.get("max")
        if lo is None and hi == num_experts and isinstance(index.args[0], Node):
            index = index.args[0]
    return root, (x, index, weights, gate_up, down)


def match_moe(gm: GraphModule) -> int:
    """Rewrite every matching expert loop of ``gm`` into ``torch_moe``; returns the number of rewrites."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    num = 0
    for routing in _routing_matrices(gm):
        found = _match_block(routing, position)
        if found is None:
            ad_logger.info(
                f"routing matrix {routing.name!r}: its expert loop is not the SwiGLU loop torch_moe computes; "
                f"left as is"
            )
            continue
        root, (x, index, weights, gate_up, down) = found
        with gm.graph.inserting_before(root):
            num_experts = node_val(down).shape[0]
            if node_val(gate_up).shape[0] != num_experts:
                gate_up = gm.graph.call_function(aten.slice.Tensor, (gate_up, 0, 0, num_experts))
            moe = gm.graph.call_function(torch.ops.auto_deploy.torch_moe.default, (x, index, weights, gate_up, down))
        moe.meta.update({k: v for k, v in root.meta.items() if k in ("stack_trace", "nn_module_stack")})
        root.replace_all_uses_with(moe)
        num += 1
    return num


@TransformRegistry.register("match_moe_pattern")
class MatchMoePattern(BaseTransform):
    """The traced dense expert loop of each MoE block -> ``auto_deploy::torch_moe`` (see the module docstring)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        return gm, TransformInfo.changed(match_moe(gm))

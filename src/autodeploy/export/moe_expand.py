"""Expand an MoE expert loop that was traced for only a few experts to all of its experts.

With ``transforms.export_to_gm.num_moe_experts_for_export = k`` the export patch
``moe_dense_experts`` (:mod:`autodeploy.export.patches.moe`) runs its static expert loop for the
first ``k`` experts only, so ``torch.export`` traces ``k`` loop bodies instead of ``E`` (the slow
part of exporting a 64- or 256-expert model). This module rebuilds the missing ``E - k`` bodies
directly in the exported graph.

What the traced loop looks like (one experts module, expert ``e``)::

    acc_0   = aten.zeros_like(hidden)                       # before the loop
    w_up_e  = aten.select.int(<gate_up_proj get_attr>, 0, e) # expert-indexed "seeds" ...
    w_dn_e  = aten.select.int(<down_proj get_attr>, 0, e)    # (also biases [E, ...], if any)
    r_e     = aten.select.int(routing, 1, e)                 # routing column: routing is [T, E(+1)]
    ... linear / act / linear / unsqueeze / to / mul ...     # the per-expert chain
    acc_e+1 = aten.add.Tensor(acc_e, contribution_e)        # the accumulating add

The expansion, per experts module:

1. **Find the blocks.** ``aten.select.int(get_attr, 0, <int>)`` nodes are grouped by the module
   that owns the parameter (``model.layers.0.mlp.experts``). A module with at least one selected
   3D parameter is an MoE block; ``E`` is that parameter's dim 0 (from ``node.meta["val"]``, else
   the parameter itself). All 3D parameters of a block must agree on ``E`` and on the traced
   expert indices, which must be ``0..k-1``. Parameters of the same module with dim 0 == ``E``
   (expert biases ``[E, N]``) are expert-indexed too.
2. **Find the template chain** of the last traced expert ``t = k - 1``: walking the graph forward
   (topological order) from its parameter seeds, collect the nodes that depend on them until the
   accumulating add: an ``aten.add.Tensor`` with one argument depending on the seeds and the other,
   the running sum, being ``aten.zeros_like`` (``t == 0``) or the previous accumulating add. The
   chain is every node strictly between the running sum and that add that depends on a seed, where
   the seeds are the parameter selects with index ``t`` plus the routing-column select
   ``select.int(routing, 1, t)`` (``routing`` being a ``[T, E]`` or ``[T, E + 1]`` tensor built
   outside the loop). Nodes of that window that do not depend on a seed are shared, not copied.
3. **Validate** the chain: it holds a select of every 3D parameter of the block and exactly one
   routing-column select, its value reaches the add, and no chain value is used outside the chain
   other than by the add (zero-user side-effect nodes such as ``aten._assert_tensor_metadata`` are
   part of the chain and are copied). Anything else raises :class:`~autodeploy.errors.ExportError`
   naming the parameter, rather than producing a wrong graph.
4. **Replicate** the chain for experts ``k..E-1`` with :meth:`torch.fx.Graph.node_copy`, inserted
   after the template's add: the seed selects get the new expert index, the other nodes keep their
   arguments (remapped to the copies), and each copy ends with a new accumulating add on the
   previous one. ``node_copy`` copies ``node.meta``, so ``meta["val"]`` stays valid (per-expert
   shapes are identical). The users of the old final accumulator are redirected to the new one.

Experts are appended in index order after the traced ones, so the expanded graph computes the
same sum in the same order as a full export (identical numerics, same per-expert node counts).
If ``k >= E`` there is nothing to expand and the graph is left untouched.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from ..errors import ExportError
from ..utils.fx import node_val
from ..utils.logger import ad_logger

_aten = torch.ops.aten


@dataclass
class _Block:
    """One experts module of the exported graph."""

    module: str
    num_experts: int
    params_3d: list[str] = field(default_factory=list)  # get_attr targets of the [E, ., .] params
    # expert index -> the select.int(get_attr, 0, index) nodes of this block's expert params
    seeds: dict[int, list[Node]] = field(default_factory=lambda: defaultdict(list))


def _attr_value(gm: GraphModule, node: Node):
    val = node_val(node)
    if val is not None:
        return val
    obj = gm
    for name in node.target.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _is_param_select(node: Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is _aten.select.int
        and len(node.args) == 3
        and isinstance(node.args[0], Node)
        and node.args[0].op == "get_attr"
        and node.args[1] == 0
        and isinstance(node.args[2], int)
        and not node.kwargs
    )


def _find_blocks(gm: GraphModule) -> list[_Block]:
    """Group ``select.int(<param>, 0, e)`` nodes by the module that owns the parameter."""
    by_target: dict[str, list[Node]] = defaultdict(list)
    shapes: dict[str, tuple] = {}
    for node in gm.graph.nodes:
        if _is_param_select(node):
            attr = node.args[0]
            value = _attr_value(gm, attr)
            if value is None or not hasattr(value, "shape"):
                continue
            by_target[attr.target].append(node)
            shapes[attr.target] = tuple(value.shape)

    by_module: dict[str, list[str]] = defaultdict(list)
    for target in by_target:
        by_module[target.rpartition(".")[0]].append(target)

    blocks = []
    for module, targets in by_module.items():
        params_3d = [t for t in targets if len(shapes[t]) == 3]
        if not params_3d:
            continue
        sizes = {t: int(shapes[t][0]) for t in params_3d}
        if len(set(sizes.values())) != 1:
            raise ExportError(
                f"MoE expansion: the expert parameters of {module!r} disagree on the number of experts "
                f"(dim 0): {sizes}"
            )
        block = _Block(module, next(iter(sizes.values())), params_3d)
        for target in targets:
            if int(shapes[target][0]) != block.num_experts:
                continue  # not indexed by expert
            for node in by_target[target]:
                block.seeds[node.args[2]].append(node)
        blocks.append(block)
    return blocks


def _traced_indices(block: _Block) -> list[int]:
    """The expert indices traced for the block; every 3D parameter must have the same ones."""
    per_param: dict[str, set[int]] = defaultdict(set)
    for index, nodes in block.seeds.items():
        for node in nodes:
            per_param[node.args[0].target].add(index)
    reference = per_param[block.params_3d[0]]
    for target in block.params_3d[1:]:
        if per_param[target] != reference:
            raise ExportError(
                f"MoE expansion: parameter {target!r} is selected for experts {sorted(per_param[target])} but "
                f"{block.params_3d[0]!r} for experts {sorted(reference)}; expected the same experts for both"
            )
    indices = sorted(reference)
    if indices != list(range(len(indices))):
        raise ExportError(
            f"MoE expansion: parameter {block.params_3d[0]!r} is selected for experts {indices}; "
            f"expected the first experts 0..k-1 of the traced loop"
        )
    return indices


def _is_routing_select(node: Node, index: int, num_experts: int) -> bool:
    if node.op != "call_function" or node.target is not _aten.select.int or len(node.args) != 3:
        return False
    source, dim, idx = node.args
    if not isinstance(source, Node) or source.op == "get_attr" or dim != 1 or idx != index:
        return False
    val = node_val(source)
    return val is not None and val.dim() == 2 and val.shape[1] in (num_experts, num_experts + 1)


def _find_accumulate(block: _Block, index: int, position: dict[Node, int]) -> tuple[Node, Node, Node]:
    """(accumulating add, running sum, contribution): the add of expert ``index``'s contribution."""
    seeds = block.seeds[index]
    dependent = set(seeds)
    node = min(seeds, key=position.__getitem__)
    name = block.params_3d[0]
    while node.op != "output":
        if node not in dependent and node.op == "call_function":
            if any(arg in dependent for arg in node.all_input_nodes):
                if _is_accumulate(node, dependent, index):
                    a, b = node.args
                    return (node, a, b) if b in dependent else (node, b, a)
                dependent.add(node)
        node = node.next
    raise ExportError(
        f"MoE expansion: no accumulating add found for expert {index} of parameter {name!r}: expected "
        f"`out = out + contribution` after the expert's chain (the loop of the moe_dense_experts export patch)"
    )


def _is_accumulate(node: Node, dependent: set[Node], index: int) -> bool:
    if node.target is not _aten.add.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    a, b = node.args
    if not (isinstance(a, Node) and isinstance(b, Node)) or (a in dependent) == (b in dependent):
        return False
    running = a if b in dependent else b
    expected = _aten.zeros_like.default if index == 0 else _aten.add.Tensor
    return running.op == "call_function" and running.target is expected


def _template_chain(block: _Block, index: int, position: dict[Node, int]) -> tuple[list[Node], Node, Node, set[Node]]:
    """(chain nodes in order, running-sum input, accumulating add, seed selects) for expert ``index``."""
    accumulate, running, contribution = _find_accumulate(block, index, position)
    param_seeds = set(block.seeds[index])
    name = block.params_3d[0]

    seeds: set[Node] = set()
    chain: list[Node] = []
    in_chain: set[Node] = set()
    routing = []
    node = running.next
    while node is not accumulate:
        if node.op == "call_function":
            if node in param_seeds:
                seeds.add(node)
            elif _is_routing_select(node, index, block.num_experts):
                seeds.add(node)
                routing.append(node)
            elif not any(arg in in_chain for arg in node.all_input_nodes):
                node = node.next
                continue  # does not depend on the expert: shared by all copies
            chain.append(node)
            in_chain.add(node)
        node = node.next

    missing = [t for t in block.params_3d if not any(s.args[0].target == t for s in seeds)]
    if missing:
        raise ExportError(
            f"MoE expansion: the loop body of expert {index} does not select parameter(s) {missing} between the "
            f"running sum {running.name!r} and the accumulating add {accumulate.name!r}"
        )
    if len(routing) != 1:
        raise ExportError(
            f"MoE expansion: expected one routing-column select `select.int(routing, 1, {index})` in the loop body "
            f"of expert {index} of parameter {name!r}, found {len(routing)}"
        )
    if contribution not in in_chain:
        raise ExportError(
            f"MoE expansion: the value added by {accumulate.name!r} is not computed in the loop body of expert "
            f"{index} of parameter {name!r}"
        )
    for member in chain:
        for user in member.users:
            if user not in in_chain and user is not accumulate:
                raise ExportError(
                    f"MoE expansion: {member.name!r}, computed for expert {index} of parameter {name!r}, is used "
                    f"outside the expert's loop body (by {user.name!r}); cannot replicate it per expert"
                )
    return chain, running, accumulate, seeds


def _expand_block(graph: Graph, block: _Block, num_traced: int, position: dict[Node, int]) -> None:
    template = num_traced - 1
    chain, running, accumulate, seeds = _template_chain(block, template, position)

    cursor = accumulate
    previous = accumulate
    first_new = None
    for expert in range(num_traced, block.num_experts):
        env: dict[Node, Node] = {}
        for node in chain:
            with graph.inserting_after(cursor):
                copy = graph.node_copy(node, lambda arg, env=env: env.get(arg, arg))
            if node in seeds:
                copy.args = (copy.args[0], copy.args[1], expert)
            env[node] = copy
            cursor = copy
        env[running] = previous
        with graph.inserting_after(cursor):
            new_accumulate = graph.node_copy(accumulate, lambda arg, env=env: env.get(arg, arg))
        if first_new is None:
            first_new = new_accumulate
        cursor = previous = new_accumulate

    accumulate.replace_all_uses_with(previous, delete_user_cb=lambda user: user is not first_new)


def expand_moe_experts(gm: GraphModule, num_traced: int) -> int:
    """Replicate the last traced expert's chain for the untraced experts of every MoE block.

    Returns the number of MoE blocks expanded (0 when nothing needed expanding).
    """
    if not isinstance(num_traced, int) or isinstance(num_traced, bool) or num_traced < 1:
        raise ExportError(f"num_moe_experts_for_export must be an integer >= 1, got {num_traced!r}")
    blocks = _find_blocks(gm)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    expanded = 0
    for block in blocks:
        indices = _traced_indices(block)
        if len(indices) >= block.num_experts:
            continue  # every expert is in the graph already
        if len(indices) != num_traced:
            raise ExportError(
                f"MoE expansion: parameter {block.params_3d[0]!r} has {len(indices)} traced experts of "
                f"{block.num_experts}, but num_moe_experts_for_export={num_traced}"
            )
        _expand_block(gm.graph, block, num_traced, position)
        expanded += 1
        ad_logger.debug(f"expanded MoE block {block.module}: {num_traced} -> {block.num_experts} experts")
    if expanded:
        gm.graph.lint()
        gm.recompile()
        ad_logger.info(f"expanded {expanded} MoE block(s) from {num_traced} traced experts")
    return expanded

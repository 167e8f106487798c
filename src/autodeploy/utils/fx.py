"""Small torch.fx helpers shared by transforms: iteration, clean-up, shape propagation, op naming."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from torch.fx import GraphModule, Node


def named_graphmodules(mod: nn.Module) -> Iterator[tuple[str, GraphModule]]:
    """Every GraphModule under ``mod`` (the root included), in ``named_modules()`` order."""
    for name, sub in mod.named_modules():
        if isinstance(sub, GraphModule):
            yield name, sub


def has_graphmodule(mod: nn.Module) -> bool:
    return next(named_graphmodules(mod), None) is not None


def op_name(node: Node) -> str:
    """A readable name for what a node computes: ``aten.mm.default``, ``getattr``, ``placeholder``."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            namespace = target.namespace
            return f"{namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
        if isinstance(target, torch._ops.OpOverloadPacket):
            return f"{target._qualified_op_name.replace('::', '.')}"
        return getattr(target, "__name__", str(target))
    if node.op in ("call_method", "call_module"):
        return str(node.target)
    return node.op


def canonicalize_graph(gm: GraphModule) -> None:
    """Bring a graph to the 'clean' state every transform may assume.

    Dead code is removed, unused submodules/attributes are deleted, the graph is linted and the
    Python code regenerated.
    """
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()


def get_attr_tensor(gm: GraphModule, target: str) -> torch.Tensor:
    """The tensor a ``get_attr`` node with this target reads (dotted path under ``gm``)."""
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def tensor_name_counts(gm: nn.Module) -> dict[int, int]:
    """How many parameter/buffer names each tensor (by data pointer) has: more than one means tied
    weights, which a rewrite must not delete or replace under one name only."""
    counts: dict[int, int] = {}
    for _, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        counts[t.data_ptr()] = counts.get(t.data_ptr(), 0) + 1
    return counts


def delete_attr_tensor(gm: GraphModule, target: str) -> None:
    """Remove the parameter / buffer / attribute at a dotted path, so its memory can be freed."""
    module_name, _, attr = target.rpartition(".")
    module = gm.get_submodule(module_name) if module_name else gm
    if attr in module._parameters:
        del module._parameters[attr]
    elif attr in module._buffers:
        del module._buffers[attr]
    else:
        delattr(module, attr)


def copy_out_cpu_tensors(mod: nn.Module, keep: set[int]) -> int:
    """Replace every CPU parameter/buffer of ``mod`` whose data pointer is not in ``keep`` by a copy of its
    own (tied names keep sharing one copy). Weights loaded from a memory-mapped checkpoint keep the whole
    file mapped, and its touched pages resident, while any one of them lives: once a rewrite has replaced
    most of them (``quantize_weights``), copying the rest out lets the map go. Returns the bytes copied."""
    copies: dict[int, torch.Tensor] = {}
    for module in mod.modules():
        for kind in ("_parameters", "_buffers"):
            slots = getattr(module, kind)
            for name, t in list(slots.items()):
                if t is None or t.device.type != "cpu" or t.data_ptr() in keep:
                    continue
                if t.data_ptr() not in copies:
                    copy = t.detach().clone()
                    copies[t.data_ptr()] = nn.Parameter(copy, requires_grad=t.requires_grad) if kind == "_parameters" else copy
                slots[name] = copies[t.data_ptr()]
    return sum(t.numel() * t.element_size() for t in copies.values())


def placeholder_fake_values(gm: GraphModule) -> list:
    return [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]


def run_shape_prop(gm: GraphModule) -> None:
    """Re-propagate fake tensors through the graph so every ``node.meta["val"]`` is current.

    Uses the symbolic fake inputs recorded at export, so dynamic dimensions stay symbolic.
    """
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = placeholder_fake_values(gm)
    if any(v is None for v in inputs):
        raise RuntimeError("shape propagation needs node.meta['val'] on every placeholder (set at export)")
    fake_mode = detect_fake_mode(inputs)
    with fake_mode:
        fake_mode.allow_non_fake_inputs = True
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)


def replace_device_args(gm: GraphModule, old: torch.device, new: torch.device) -> int:
    """Rewrite ``device=old`` arguments baked into graph nodes (e.g. aten.arange(device=meta))."""
    old, new = torch.device(old), torch.device(new)
    changed = 0

    def swap(value):
        nonlocal changed
        if isinstance(value, torch.device) and value == old:
            changed += 1
            return new
        return value

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, swap)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
    if changed:
        gm.recompile()
    return changed

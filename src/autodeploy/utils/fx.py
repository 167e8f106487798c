"""The graph helpers every transform shares: node values and shapes, symbolic size equality, op
arguments by name, iteration over graph modules, clean-up, shape propagation, op naming.

A transform never re-derives these answers: "what does this node compute, with which shape?"
(:func:`node_val`), "are these two sizes equal?" (:func:`sizes_equal`, :func:`same_shape`), "which
argument is which?" (:func:`op_args`). Whether a node is a linear product is the product-op registry's
question (:mod:`autodeploy.utils.products`).
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
from torch import nn
from torch.fx import GraphModule, Node


def node_val(node: Any) -> torch.Tensor | None:
    """The (fake) tensor a node computes, from ``node.meta["val"]``; None for non-nodes, non-tensors and
    nodes without a recorded value."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def static_int(size: Any) -> int | None:
    """``size`` as a Python int when it is one (or a SymInt with a fixed value); None when symbolic."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return None


def sizes_equal(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) are provably equal, without adding guards: False when unknown."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    # imported here: symbolic_shapes brings sympy (40 MiB), which a process serving a built model never needs
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - an undecidable symbolic comparison means "not provably equal"
        return False


def same_shape(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same rank and provably equal sizes; False when either is unknown."""
    return (a is not None and b is not None and a.dim() == b.dim()
            and all(sizes_equal(x, y) for x, y in zip(a.shape, b.shape)))


def same_tensor_type(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """:func:`same_shape` and the same dtype."""
    return same_shape(a, b) and a.dtype == b.dtype


def is_call(node: Any, target: Any) -> bool:
    """Whether ``node`` is a ``call_function`` node of ``target``."""
    return isinstance(node, Node) and node.op == "call_function" and node.target == target


def op_args(node: Node) -> dict[str, Any]:
    """An op node's arguments by schema name, positional or keyword, defaults filled in."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


def text_config(config: Any) -> Any:
    """The text model's part of an HF config (``get_text_config()`` for multimodal configs), or the config."""
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def named_graphmodules(mod: nn.Module) -> Iterator[tuple[str, GraphModule]]:
    """Every GraphModule under ``mod`` (the root included), in ``named_modules()`` order."""
    for name, sub in mod.named_modules():
        if isinstance(sub, GraphModule):
            yield name, sub


def set_submodule(root: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at the dotted path ``name`` under ``root``; returns ``root``."""
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)
    return root


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


def read_as_embedding_table_only(node: Node) -> bool:
    """Whether the ``get_attr`` ``node`` is read, and only as the table of embedding lookups (whose pages a
    lookup touches a row at a time)."""
    lookup = torch.ops.aten.embedding.default
    return bool(node.users) and all(user.target is lookup and user.args[0] is node for user in node.users)


def get_attr_tensor(gm: GraphModule, target: str) -> torch.Tensor:
    """The tensor a ``get_attr`` node with this target reads (dotted path under ``gm``)."""
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def graph_tensors(mod: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``mod`` by qualified name, tied ones under each of their names."""
    tensors = dict(mod.named_parameters(remove_duplicate=False))
    tensors.update(mod.named_buffers(remove_duplicate=False))
    return tensors


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


def swap_attr_tensors(gm: GraphModule, old: list[str], new: list[tuple[str, torch.Tensor]], before: Node,
                      parameter: bool = False) -> list[Node]:
    """A weight rewrite's bookkeeping: delete the tensors at the dotted paths ``old`` (so their memory can be
    freed), register each ``(name, tensor)`` of ``new`` on ``gm`` (buffers, or frozen parameters with
    ``parameter``), and return ``get_attr`` nodes reading them, inserted before ``before``. The caller rewires
    the users and erases the old ``get_attr`` nodes."""
    for target in old:
        delete_attr_tensor(gm, target)
    for name, tensor in new:
        if parameter:
            gm.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        else:
            gm.register_buffer(name, tensor)
    with gm.graph.inserting_before(before):
        return [gm.graph.get_attr(name) for name, _ in new]


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
                    copies[t.data_ptr()] = (
                        nn.Parameter(copy, requires_grad=t.requires_grad) if kind == "_parameters" else copy
                    )
                slots[name] = copies[t.data_ptr()]
    return sum(t.numel() * t.element_size() for t in copies.values())


def graph_fake_mode(gm: GraphModule):
    """The fake mode (and shape environment) of the graph's recorded placeholder values, or None."""
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]) if vals else None


def fake_input(fake_mode, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
    """A fake tensor for a new placeholder ``name``; str entries of ``shape`` become fresh dynamic sizes of
    the graph's shape environment. None without a fake mode."""
    if fake_mode is None:
        return None
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    sizes = []
    for i, dim in enumerate(shape):
        if isinstance(dim, str) and fake_mode.shape_env is not None:
            env, source = fake_mode.shape_env, ConstantSource(f"{name}_{dim}_{i}")
            sym = env.create_symbol(2, source=source, dynamic_dim=DimDynamic.DYNAMIC)
            sizes.append(env.create_symintnode(sym, hint=2, source=source))
        else:
            sizes.append(2 if isinstance(dim, str) else dim)
    with fake_mode:
        return torch.empty(sizes, dtype=dtype)


def add_placeholder(gm: GraphModule, name: str, val: torch.Tensor | None) -> Node:
    """A new last graph input ``name`` (its ``meta["val"]`` set when given); ValueError if the name is taken."""
    last = list(gm.graph.find_nodes(op="placeholder"))[-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(name)
    if node.name != name:
        gm.graph.erase_node(node)
        raise ValueError(f"the graph already has a node named {name!r}")
    if val is not None:
        node.meta["val"] = val
    return node


def placeholder_fake_values(gm: GraphModule) -> list:
    return [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]


#: node.meta key: what the node's value was last propagated from (see :func:`run_shape_prop`)
_SHAPE_SIGNATURE = "autodeploy_shape_signature"


def _shape_signature(node: Node) -> str:
    """What a node's value depends on besides its inputs' values: its op, target and arguments (inputs by
    name)."""
    def by_name(n: Node) -> str:
        return f"%{n.name}"

    return repr((node.op, node.target, torch.fx.node.map_arg(node.args, by_name),
                 torch.fx.node.map_arg(node.kwargs, by_name)))


def _same_sizes(a, b) -> bool:
    """Sizes (or strides) equal as written: ints by value, symbolic ones by expression (no guards added)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.SymInt) and isinstance(y, torch.SymInt):
            if x.node.expr != y.node.expr:
                return False
        elif isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt) or x != y:
            return False
    return True


def _same_value(old: Any, new: Any) -> bool:
    """Whether two node values describe the same tensors (dtype, device, sizes and strides as written) and
    the same other values."""
    from torch.utils._pytree import tree_flatten

    old_leaves, old_spec = tree_flatten(old)
    new_leaves, new_spec = tree_flatten(new)
    if old_spec != new_spec:
        return False
    for a, b in zip(old_leaves, new_leaves):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if (a.dtype != b.dtype or a.device != b.device or not _same_sizes(a.shape, b.shape)
                    or not _same_sizes(a.stride(), b.stride())):
                return False
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or str(a) != str(b):
            return False
    return True


@functools.cache
def _incremental_prop_class():
    """The incremental FakeTensorProp class, made once (imported lazily: torch's fake-tensor propagation takes
    about a second to import)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class IncrementalFakeTensorProp(FakeTensorProp):
        """Recomputes only the nodes whose value may have changed: those without a value, whose op or
        arguments changed since their value was propagated (:func:`_shape_signature`), or with an input whose
        value changed; and every ``get_attr`` (a transform may have replaced the tensor behind it). Every
        other node keeps its value, which its users read."""

        def __init__(self, gm: GraphModule, mode):
            super().__init__(gm, mode)
            self.changed: set[Node] = set()

        def run_node(self, n: Node) -> Any:
            if n.op in ("placeholder", "output"):
                return super().run_node(n)
            signature = _shape_signature(n)
            if (n.op != "get_attr" and "val" in n.meta and n.meta.get(_SHAPE_SIGNATURE) == signature
                    and not any(i in self.changed for i in n.all_input_nodes)):
                return n.meta["val"]
            old = n.meta.get("val")
            result = super().run_node(n)
            n.meta[_SHAPE_SIGNATURE] = signature
            if old is None or not _same_value(old, n.meta.get("val")):
                self.changed.add(n)
            return result

    return IncrementalFakeTensorProp


def mark_shapes_current(gm: GraphModule) -> int:
    """Record every node's value as current (where it has one), so that :func:`run_shape_prop` next recomputes
    only what changes after this point. For a graph fresh from ``torch.export``, whose values are exact: the
    first propagation after export recomputed all of them (1.5 s of a 125M Llama's build). Returns how many
    nodes were marked."""
    marked = 0
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta[_SHAPE_SIGNATURE] = _shape_signature(node)
            marked += 1
    return marked


def run_shape_prop(gm: GraphModule) -> None:
    """Re-propagate fake tensors through the graph so every ``node.meta["val"]`` is current.

    Uses the symbolic fake inputs recorded at export, so dynamic dimensions stay symbolic. Runs under the
    Python dispatcher, as export does: some meta kernels (``aten.baddbmm``'s, which expands ``self`` to
    symbolic sizes: Bloom's ALiBi scores) only reach the SymInt-aware kernels of the ops they call there.

    Incremental: only the nodes whose value may have changed since the last propagation are recomputed (a
    pattern matcher rewrites a few nodes per layer; recomputing all of them after every transform was half
    of a build's time). Should that fail, the whole graph is propagated again.
    """
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = placeholder_fake_values(gm)
    if any(v is None for v in inputs):
        raise RuntimeError("shape propagation needs node.meta['val'] on every placeholder (set at export)")
    fake_mode = detect_fake_mode(inputs)
    with fake_mode, enable_python_dispatcher():
        fake_mode.allow_non_fake_inputs = True
        try:
            _incremental_prop_class()(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
        except Exception:  # noqa: BLE001 - a value kept from another propagation that no longer fits: redo all
            for node in gm.graph.nodes:
                node.meta.pop(_SHAPE_SIGNATURE, None)
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

"""The registry of product ops: every op that computes a linear product ``x @ W.T (+ bias)``.

Transforms ask this registry, and only it, whether a node is a product and which of its arguments are the
input, the weight (with its per-output-row companions, such as int8 scales) and the bias, and they rebuild
products through it. Each product op declares itself once, in the file that defines the op
(``register_product``): ``aten.linear`` and ``auto_deploy::f32_linear`` in ``custom_ops/linear.py``,
``auto_deploy::torch_int8_linear`` in ``custom_ops/quant_linear.py``, ``auto_deploy::half_linear`` (16-bit
weights) in ``custom_ops/half_linear.py``, ``auto_deploy::int4_linear`` in ``custom_ops/int4_linear.py``.
Adding a product op means its op file and that one entry: fusion, quantization, ``native_linear``, the
logits gather and the compile forms find it here. (The op files register when ``autodeploy.custom_ops`` is
imported, which the transform library does first.)

    product = product_of(node)          # None unless node calls a registered product op
    product.input, product.weight, product.row_tensors, product.bias, product.static
    product.replace(op=INT8_LINEAR, row_tensors=[q, scale])   # a new node in its place
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch.fx import Graph, Node

from .fx import op_args

_UNSET: Any = object()


@dataclass(frozen=True)
class ProductOp:
    """How one op expresses ``x @ W.T + bias``.

    ``input_arg``: the argument holding the activations, one row per token (last dim K).
    ``row_args``: the per-output-row tensors, weight first (``("weight",)``, or ``("weight", "scale")`` for
    int8 weights with one scale per row); concatenating each along dim 0 concatenates products.
    ``bias_arg``: the optional bias argument. ``static_args``: non-tensor arguments that describe the weight
    layout (int4's ``group_size``): carried over when a product is rebuilt, and equal within a fused group.
    ``dense``: the weight is a plain floating-point [N, K] matrix
    (what quantization and native kernels start from). ``row_major``: ``row_args`` hold one row per output
    feature (False for a layout packed in tiles of rows, which fusion and sharding must not concatenate or
    split). ``compile_form``: ``(decode) -> callable`` giving the
    plain-torch form of the op for ``torch.compile`` (None: the op stays an opaque call)."""

    op: Any
    input_arg: str
    row_args: tuple[str, ...]
    bias_arg: str | None = "bias"
    static_args: tuple[str, ...] = ()
    dense: bool = False
    row_major: bool = True
    compile_form: Callable[[bool], Callable] | None = None

    @property
    def arg_names(self) -> list[str]:
        return [arg.name for arg in self.op._schema.arguments]

    def call(self, graph: Graph, input: Node, row_tensors: list[Node], bias: Node | None,
             static: dict[str, Any] | None = None) -> Node:
        """A new node of this op (inserted at the graph's insertion point); ``static``: the values of
        ``static_args`` (all of them)."""
        static = dict(static or {})
        if set(static) != set(self.static_args):
            raise ValueError(f"{self.op} takes the static arguments {self.static_args}, got {tuple(static)}")
        values = {self.input_arg: input, **dict(zip(self.row_args, row_tensors, strict=True)), **static}
        if self.bias_arg is not None:
            values[self.bias_arg] = bias
        elif bias is not None:
            raise ValueError(f"{self.op} takes no bias")
        names = self.arg_names
        args = [values.get(name) for name in names]
        while args and args[-1] is None and names[len(args) - 1] == self.bias_arg:  # leave the default out
            args.pop()
        return graph.call_function(self.op, tuple(args))


@dataclass
class Product:
    """One product node, read through its :class:`ProductOp`."""

    node: Node
    kind: ProductOp
    input: Any
    row_tensors: list[Any] = field(default_factory=list)
    bias: Any = None
    static: dict[str, Any] = field(default_factory=dict)

    @property
    def weight(self) -> Any:
        return self.row_tensors[0]

    def replace(self, op: ProductOp | None = None, input: Any = _UNSET, row_tensors: list[Any] | None = None,
                bias: Any = _UNSET, static: dict[str, Any] | None = None) -> Node:
        """Put a product of ``op`` (default: the same op) in this node's place, with the given parts (default:
        this product's; ``static`` defaults to this product's for the same op, none for another), and erase
        this node. Returns the new node."""
        op = op or self.kind
        if static is None:
            static = self.static if op is self.kind else {}
        graph = self.node.graph
        with graph.inserting_before(self.node):
            new = op.call(graph, self.input if input is _UNSET else input,
                          self.row_tensors if row_tensors is None else row_tensors,
                          self.bias if bias is _UNSET else bias, static)
        new.meta.update(self.node.meta)
        self.node.replace_all_uses_with(new)
        graph.erase_node(self.node)
        return new


_PRODUCTS: dict[Any, ProductOp] = {}


def register_product(kind: ProductOp) -> ProductOp:
    """Declare an op as a product (once, beside the op's definition)."""
    if kind.op in _PRODUCTS and _PRODUCTS[kind.op] != kind:
        raise ValueError(f"{kind.op} is already registered as a product")
    _PRODUCTS[kind.op] = kind
    return kind


def product_ops() -> list[ProductOp]:
    """Every registered product op."""
    return list(_PRODUCTS.values())


def product_of(node: Any) -> Product | None:
    """The product ``node`` computes, or None when it does not call a registered product op."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    kind = _PRODUCTS.get(node.target)
    if kind is None:
        return None
    args = op_args(node)
    return Product(node, kind, args[kind.input_arg], [args[name] for name in kind.row_args],
                   args[kind.bias_arg] if kind.bias_arg else None, {name: args[name] for name in kind.static_args})


def products_of_kind(graph: Graph, kind: ProductOp) -> list[Product]:
    """The products of ``kind`` in ``graph``, in graph order (what a transform rewriting one op's products walks)."""
    return [p for p in map(product_of, graph.nodes) if p is not None and p.kind is kind]


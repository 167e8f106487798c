"""The shared graph helpers: node values, symbolic size equality without guards, op arguments by name, a weight
rewrite's tensor swap."""

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autodeploy.utils.fx import (
    is_call,
    node_val,
    op_args,
    same_shape,
    same_tensor_type,
    sizes_equal,
    static_int,
    swap_attr_tensors,
    text_config,
)
from helpers import export_gm


def _symbols(*hints):
    env = ShapeEnv(duck_shape=False)  # two sizes with one hint stay two symbols
    from torch._dynamo.source import ConstantSource

    return [env.create_symintnode(env.create_symbol(h, ConstantSource(f"s{i}")), hint=h, source=ConstantSource(f"s{i}"))
            for i, h in enumerate(hints)]


def test_sizes_equal_is_provable_equality_only():
    a, b = _symbols(4, 4)  # two sizes that happen to be equal now
    assert sizes_equal(3, 3) and not sizes_equal(3, 4)
    assert sizes_equal(a, a) and sizes_equal(a * 2, a + a)
    assert not sizes_equal(a, b)  # equal hints are not equal sizes
    assert not sizes_equal(a, 4)
    assert static_int(7) == 7 and static_int(a) is None and static_int("x") is None


def test_same_shape_and_type():
    a, b = _symbols(4, 4)
    x, y = torch.empty(2, 3), torch.empty(2, 3, dtype=torch.float16)
    assert same_shape(x, y) and not same_tensor_type(x, y) and same_tensor_type(x, x.clone())
    assert not same_shape(x, torch.empty(3, 2)) and not same_shape(x, None) and not same_shape(None, None)


def test_node_val_is_call_and_op_args():
    gm = export_gm(torch.nn.Linear(4, 2), torch.randn(3, 4))
    (linear,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
    assert is_call(linear, torch.ops.aten.linear.default) and not is_call(linear, torch.ops.aten.mm.default)
    assert node_val(linear).shape == (3, 2) and node_val(None) is None and node_val(3) is None
    args = op_args(linear)
    assert list(args) == ["input", "weight", "bias"] and args["input"].op == "placeholder"


def test_text_config_of_a_multimodal_config():
    class Text:
        vocab_size = 11

    class Multi:
        def get_text_config(self):
            return Text()

    assert text_config(Multi()).vocab_size == 11
    assert isinstance(text_config(Text()), Text)


def test_shape_prop_through_baddbmm_of_symbolic_sizes(tmp_path):
    """Bloom's ALiBi scores (``alibi.baddbmm(q, k^T)`` over [batch * heads, ...]): baddbmm's meta kernel expands
    to symbolic sizes, which only works under the Python dispatcher (as during export)."""
    import autodeploy
    from autodeploy.coverage import make_checkpoint
    from autodeploy.utils.fx import run_shape_prop

    gm = autodeploy.optimize(make_checkpoint("bloom", tmp_path / "bloom"), until="export")
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.aten.baddbmm.default)
    run_shape_prop(gm)


def test_exported_values_count_as_current(tiny_checkpoint):
    """The graph from the export stage has its values marked current: the first propagation keeps them."""
    import autodeploy
    from autodeploy.utils.fx import run_shape_prop

    gm = autodeploy.optimize(tiny_checkpoint("llama"), until="export")
    exported = {n: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    assert len(exported) > 50
    run_shape_prop(gm)
    assert all(n.meta["val"] is val for n, val in exported.items())


def test_shape_prop_recomputes_only_what_changed():
    """run_shape_prop keeps the value of every node whose op, arguments and inputs' values are unchanged,
    and recomputes a rewritten node and everything downstream whose value it changes."""
    from autodeploy.utils.fx import run_shape_prop

    class Two(torch.nn.Module):
        def forward(self, x):
            a = torch.relu(x)
            b = torch.sigmoid(x)
            return a * 2, b + 1

    gm = export_gm(Two(), torch.randn(3, 4), dims={0: torch.export.Dim("batch")},
                   cleanup=["cleanup_input_constraints"])
    run_shape_prop(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    kept = {name: n.meta["val"] for name, n in nodes.items() if n.op == "call_function"}
    run_shape_prop(gm)  # nothing changed: every value object is kept
    assert all(nodes[name].meta["val"] is val for name, val in kept.items())

    # relu(x) -> relu(x).sum(-1): a new node and a new shape for the product downstream of it
    relu = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.relu.default)
    with gm.graph.inserting_after(relu):
        summed = gm.graph.call_function(torch.ops.aten.sum.dim_IntList, (relu, [-1]))
    for user in list(relu.users):
        if user is not summed:
            user.replace_input_with(relu, summed)
    gm.recompile()
    run_shape_prop(gm)
    product = next(iter(summed.users))
    assert summed.meta["val"].dim() == 1 and product.meta["val"].dim() == 1
    sigmoid_branch = [n for n in gm.graph.nodes
                      if n.target in (torch.ops.aten.sigmoid.default, torch.ops.aten.add.Tensor)]
    assert sigmoid_branch and all(n.meta["val"] is kept[n.name] for n in sigmoid_branch)
    assert relu.meta["val"] is kept[relu.name]


def test_swap_attr_tensors_replaces_the_old_tensors_and_reads_the_new_ones():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 3, bias=False)
            self.register_buffer("scale", torch.ones(3))

        def forward(self, x):
            return x @ self.inner.weight.t() * self.scale

    gm = torch.fx.symbolic_trace(Two())
    olds = [n for n in gm.graph.nodes if n.op == "get_attr"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    fused = torch.arange(12.0).reshape(3, 4)
    nodes = swap_attr_tensors(gm, [n.target for n in olds], [("fused_w", fused)], olds[0], parameter=True)
    assert [n.target for n in nodes] == ["fused_w"] and nodes[0].next is olds[0]  # read before ``before``
    assert not hasattr(gm.inner, "weight") and "scale" not in dict(gm.named_buffers())  # the old ones freed
    assert isinstance(gm.fused_w, torch.nn.Parameter) and not gm.fused_w.requires_grad
    assert gm.fused_w.data_ptr() == fused.data_ptr()  # registered as it is, not copied
    [buffer] = swap_attr_tensors(gm, ["fused_w"], [("as_buffer", fused)], output)
    assert dict(gm.named_buffers())["as_buffer"] is fused and buffer.next is output

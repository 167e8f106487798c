"""The product-op registry: every product op reads through one entry (input, per-row tensors, bias), is
rebuilt through it, and the entries cover what the transforms make of a linear."""

import pytest
import torch
from torch import nn

import autodeploy.custom_ops  # noqa: F401  (registers the ops and their products)
from autodeploy.custom_ops.linear import F32_LINEAR, LINEAR
from autodeploy.custom_ops.quant_linear import INT8_LINEAR, quantize_per_channel_int8
from autodeploy.utils.products import ProductOp, product_of, product_ops, products_of_kind, register_product
from helpers import export_gm


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8, bias=True)
        self.b = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _graph():
    torch.manual_seed(0)
    return export_gm(TwoLinears(), torch.randn(3, 16))


def test_the_registered_products():
    ops = {p.op for p in product_ops()}
    assert {torch.ops.aten.linear.default, torch.ops.auto_deploy.f32_linear.default,
            torch.ops.auto_deploy.torch_int8_linear.default} <= ops
    assert LINEAR.dense and F32_LINEAR.dense and not INT8_LINEAR.dense
    assert INT8_LINEAR.row_args == ("weight", "scale") and INT8_LINEAR.compile_form is not None


def test_product_of_reads_input_weight_and_bias():
    gm = _graph()
    products = [p for p in map(product_of, gm.graph.nodes) if p is not None]
    assert [p.kind for p in products] == [LINEAR, LINEAR]
    first, second = products
    assert first.input.op == "placeholder" and first.weight.op == "get_attr" and first.bias.op == "get_attr"
    assert second.bias is None and second.input.target == torch.ops.aten.relu.default
    # anything else is not a product
    assert all(product_of(n) is None for n in gm.graph.nodes if n.op != "call_function"
               or n.target != torch.ops.aten.linear.default)
    assert product_of("not a node") is None


def test_products_of_kind_lists_one_ops_products_in_graph_order():
    gm = _graph()
    first, second = products_of_kind(gm.graph, LINEAR)
    assert first.node.next is not None and second.input.target == torch.ops.aten.relu.default
    first.replace(F32_LINEAR)
    assert [p.kind for p in products_of_kind(gm.graph, F32_LINEAR)] == [F32_LINEAR]
    assert [p.node for p in products_of_kind(gm.graph, LINEAR)] == [second.node]
    assert products_of_kind(gm.graph, INT8_LINEAR) == []


def test_replace_rebuilds_a_product_as_another_op():
    gm = _graph()
    x = torch.randn(3, 16)
    want = gm(x)
    for product in [p for p in map(product_of, gm.graph.nodes) if p is not None]:
        new = product.replace(F32_LINEAR)
        assert new.target == torch.ops.auto_deploy.f32_linear.default and product_of(new).kind is F32_LINEAR
        assert new.meta["val"].shape == product.node.meta["val"].shape  # the node's meta carries over
    gm.recompile()
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
    torch.testing.assert_close(gm(x), want, atol=1e-5, rtol=1e-5)


def test_replace_with_int8_row_tensors():
    gm = _graph()
    x = torch.randn(3, 16)
    first = next(p for p in map(product_of, gm.graph.nodes) if p is not None)
    q, scale = quantize_per_channel_int8(gm.get_parameter(first.weight.target))
    gm.register_buffer("q", q)
    gm.register_buffer("s", scale)
    with gm.graph.inserting_before(first.node):
        q_node, s_node = gm.graph.get_attr("q"), gm.graph.get_attr("s")
    new = first.replace(INT8_LINEAR, row_tensors=[q_node, s_node])
    read = product_of(new)
    assert read.kind is INT8_LINEAR and read.row_tensors == [q_node, s_node] and read.bias is first.bias
    gm.recompile()
    (out,) = gm(x)
    assert out.shape == (3, 4) and torch.isfinite(out).all()


def test_call_leaves_a_missing_bias_out_and_rejects_a_bias_an_op_has_not():
    gm = _graph()
    product = next(p for p in map(product_of, gm.graph.nodes) if p is not None and p.bias is None)
    with gm.graph.inserting_before(product.node):
        node = LINEAR.call(gm.graph, product.input, [product.weight], None)
    assert len(node.args) == 2
    gm.graph.erase_node(node)
    no_bias = ProductOp(torch.ops.auto_deploy.int8_gemv.default, input_arg="x", row_args=("weight", "scale"),
                        bias_arg=None)
    with pytest.raises(ValueError, match="takes no bias"):
        no_bias.call(gm.graph, product.input, [product.weight, product.weight], product.input)


def test_an_op_registers_once():
    assert register_product(LINEAR) is LINEAR  # the same entry again is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_product(ProductOp(torch.ops.aten.linear.default, input_arg="input", row_args=("weight",)))

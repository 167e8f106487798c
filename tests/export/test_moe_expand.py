"""num_moe_experts_for_export: trace a few experts, expand the graph to all of them afterwards.

The expanded graph must be the full export's graph (same ops in the same order, same per-expert
select nodes) and compute HF's logits.
"""

import pytest
import torch

import autodeploy
from autodeploy.errors import AutoDeployError, ExportError
from autodeploy.export.moe_expand import expand_moe_experts
from helpers import export_hf, export_tiny_hf
from tiny_models import hf_reference, random_batch

KEY = "transforms.export_to_gm.num_moe_experts_for_export"
# These tests look at the expanded expert loop itself, so the MoE matcher must leave it in place.
KEEP_LOOP = {"transforms.match_moe_pattern.enabled": False}
SHAPES = [(1, 1), (3, 5), (2, 17)]
SELECT = torch.ops.aten.select.int


def _selects(gm):
    return [n for n in gm.graph.nodes if n.target is SELECT]


def _signature(gm):
    """The graph up to node names: op kind, target and constant arguments, in order."""
    consts = (int, float, bool, type(None))
    return [(n.op, str(n.target), tuple(a for a in n.args if isinstance(a, consts))) for n in gm.graph.nodes]


def _assert_logits(gm, expected_fn, shapes=SHAPES):
    for batch, seq in shapes:
        input_ids, position_ids = random_batch(batch, seq, seed=batch * 100 + seq)
        with torch.no_grad():
            logits = gm(input_ids, position_ids)[0]
            expected = expected_fn(input_ids, position_ids)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.slow  # both MoE architectures against HF
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_two_traced_experts_match_hf_and_full_export(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    gm = autodeploy.optimize(path, until="weight_load", overrides={KEY: 2, **KEEP_LOOP})
    full = autodeploy.optimize(path, until="weight_load", overrides=KEEP_LOOP)
    reference = hf_reference(path)

    # 2 layers x 4 experts x (gate_up, down, routing column) selects, as in the full export
    assert len(_selects(gm)) == len(_selects(full)) == 2 * 4 * 3
    assert _signature(gm) == _signature(full)
    _assert_logits(gm, lambda ids, pos: reference(input_ids=ids, position_ids=pos).logits)
    _assert_logits(gm, lambda ids, pos: full(ids, pos)[0])


@pytest.mark.slow  # mixtral with 8 experts against HF
@pytest.mark.parametrize("num_traced", [1, 3])
def test_eight_experts_any_traced_count(num_traced, tiny_checkpoint):
    path = tiny_checkpoint("mixtral", num_local_experts=8)
    gm = autodeploy.optimize(path, until="weight_load", overrides={KEY: num_traced, **KEEP_LOOP})
    reference = hf_reference(path)
    indices = sorted({n.args[2] for n in _selects(gm) if n.args[0].op == "get_attr"})
    assert indices == list(range(8))
    assert len(_selects(gm)) == 2 * 8 * 3
    for node in _selects(gm):  # copies keep valid fake values: an expert's slice of the parameter
        if node.args[0].op == "get_attr":
            assert node.meta["val"].shape == node.args[0].meta["val"].shape[1:], node.name
    _assert_logits(gm, lambda ids, pos: reference(input_ids=ids, position_ids=pos).logits, SHAPES[1:])


def test_expand_returns_block_count_and_keeps_shapes():
    model, gm = export_tiny_hf("mixtral", 2, num_local_experts=6)
    assert len(_selects(gm)) == 2 * 2 * 3  # only 2 of 6 experts traced per layer
    assert expand_moe_experts(gm, 2) == 2  # one block per layer
    assert len(_selects(gm)) == 2 * 6 * 3

    # meta["val"] of the copied nodes is still what shape propagation computes
    from autodeploy.utils.fx import run_shape_prop

    before = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    run_shape_prop(gm)
    for node in gm.graph.nodes:
        old, new = before[node.name], node.meta.get("val")
        if isinstance(old, torch.Tensor):
            assert old.shape == new.shape and old.dtype == new.dtype, node.name
    _assert_logits(gm, lambda ids, pos: model(input_ids=ids, position_ids=pos).logits, SHAPES[1:])

    # already expanded: nothing left to do
    code = gm.code
    assert expand_moe_experts(gm, 2) == 0
    assert gm.code == code


@pytest.mark.parametrize("num_traced", [4, 10])
def test_traced_at_least_num_experts_is_a_noop(num_traced):
    _, gm = export_tiny_hf("mixtral", num_traced)  # 4 experts
    code, signature = gm.code, _signature(gm)
    assert expand_moe_experts(gm, num_traced) == 0
    assert gm.code == code and _signature(gm) == signature
    assert len(_selects(gm)) == 2 * 4 * 3


def test_non_moe_model_untouched():
    _, gm = export_tiny_hf("llama", 2)
    code = gm.code
    assert expand_moe_experts(gm, 2) == 0
    assert gm.code == code


def test_experts_with_bias_and_transposed_weights():
    """gpt-oss experts: [E, H, 2I] weights (is_transposed), expert biases, custom gate."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
        max_position_embeddings=256, layer_types=["full_attention"] * 2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "down_proj_bias"):
                module.gate_up_proj_bias.normal_()
                module.down_proj_bias.normal_()
    gm = export_hf(model, num_moe_experts_for_export=2)
    assert expand_moe_experts(gm, 2) == 2
    # gate_up, gate_up bias, down, down bias, routing column: per expert and layer
    assert len(_selects(gm)) == 2 * 6 * 5
    _assert_logits(gm, lambda ids, pos: model(input_ids=ids, position_ids=pos).logits, SHAPES[1:])


def test_zero_experts_is_a_clear_error(tiny_checkpoint):
    with pytest.raises(AutoDeployError, match="num_moe_experts_for_export must be >= 1"):
        autodeploy.optimize(tiny_checkpoint("mixtral"), until="export", overrides={KEY: 0})
    _, gm = export_tiny_hf("mixtral", 2)
    with pytest.raises(ExportError, match="num_moe_experts_for_export must be an integer >= 1, got 0"):
        expand_moe_experts(gm, 0)


def test_unexpected_structure_names_the_parameter():
    _, gm = export_tiny_hf("mixtral", 2)
    # break the routing-column select of the last traced expert of layer 0
    routing = [n for n in _selects(gm) if n.args[0].op != "get_attr" and n.args[2] == 1]
    routing[0].args = (routing[0].args[0], 1, 0)
    with pytest.raises(ExportError, match=r"routing-column select.*'model\.layers\.0\.mlp\.experts\.gate_up_proj'"):
        expand_moe_experts(gm, 2)


def test_traced_count_mismatch_is_an_error():
    _, gm = export_tiny_hf("mixtral", 2)
    with pytest.raises(ExportError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*2 traced experts of 4"):
        expand_moe_experts(gm, 3)

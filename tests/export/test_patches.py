"""Export patches: each one changes tracing only while active and keeps the computed values."""

import pytest
import torch

from autodeploy.errors import ConfigError
from autodeploy.export.patches import ExportPatchRegistry, apply_export_patches


def test_registered_patches():
    assert {"autocast_noop", "torch_where_single_arg", "moe_dense_experts"} <= set(ExportPatchRegistry.names())


def test_unknown_patch_name_is_a_clear_error():
    with pytest.raises(ConfigError, match="autocast_nop.*did you mean 'autocast_noop'"):
        ExportPatchRegistry.resolve(["autocast_nop"])


class WhereOneArg(torch.nn.Module):
    def forward(self, x):
        rows, cols = torch.where(x > 0)
        return rows.sum() + cols.sum()


def test_torch_where_single_arg_patch_is_equivalent_and_restored():
    x = torch.tensor([[1.0, -1.0], [2.0, 3.0]])
    model = WhereOneArg()
    expected = model(x)
    original = torch.where
    with apply_export_patches(model, None, ["torch_where_single_arg"]) as applied:
        assert applied == ["torch_where_single_arg"]
        assert torch.where is not original
        assert torch.equal(model(x), expected)
        assert torch.equal(torch.where(x > 0, x, 0.0), original(x > 0, x, 0.0))
    assert torch.where is original


class Autocast(torch.nn.Module):
    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):  # as HF's RoPE does
            return x.float() * 2


def test_autocast_noop_lets_meta_tensors_trace():
    model = Autocast()
    x = torch.randn(2, 3, device="meta")
    with pytest.raises(RuntimeError):
        torch.export.export(model, (x,))
    with apply_export_patches(model, None, ["autocast_noop"]):
        program = torch.export.export(model, (x,))
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mul.Tensor in ops
    assert torch.autocast is not None and torch.autocast.__name__ == "autocast"  # restored


def test_empty_patch_list_applies_nothing():
    with apply_export_patches(torch.nn.Linear(2, 2), None, []) as applied:
        assert applied == []


class DataTensors(torch.nn.Module):
    """Falcon's list index (qkv[..., [-2]]) and a torch.tensor made on the input's device."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 24)

    def forward(self, x):
        q = self.lin(x).view(x.shape[0], 3, 8)
        scale = torch.tensor(0.5, device=x.device)
        return (q[:, [-2]] * scale + q[:, [True, False, True]].sum(1, keepdim=True),)


def test_tensor_constants_off_meta_keeps_their_values():
    from autodeploy.export.export import assign_tensor
    from autodeploy.transform.library.load_weights import _meta_attributes
    from autodeploy.utils.fx import replace_device_args

    torch.manual_seed(0)
    real = DataTensors()
    with torch.device("meta"):
        model = DataTensors()
    x = torch.randn(3, 8)
    dims = ({0: torch.export.Dim("b", min=1, max=8)},)
    with apply_export_patches(model, None, ["tensor_constants_off_meta"]) as applied:
        assert applied == ["tensor_constants_off_meta"]
        program = torch.export.export(model, (x.to("meta"),), dynamic_shapes=dims, strict=False)
    assert len(program.constants) == 3 and all(c.device.type == "cpu" for c in program.constants.values())
    gm = program.module()
    for name, tensor in real.state_dict().items():
        assign_tensor(gm, name, tensor)
    replace_device_args(gm, torch.device("meta"), torch.device("cpu"))
    assert _meta_attributes(gm) == []  # nothing left for a checkpoint to provide
    torch.testing.assert_close(gm(x)[0], real(x)[0], rtol=0, atol=0)
    # without the patch the constants are lifted on meta: their values are gone
    program = torch.export.export(model, (x.to("meta"),), dynamic_shapes=dims, strict=False)
    assert all(c.is_meta for c in program.constants.values())


def test_tensor_constants_off_meta_skips_real_models():
    with apply_export_patches(torch.nn.Linear(2, 2), None, ["tensor_constants_off_meta"]) as applied:
        assert applied == []


# -- sparse_attention_indexer (DeepSeek-V3.2's DSA) ------------------------------------------------
def _tiny_dsa(index_topk: int = 2048):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from autodeploy.coverage import tiny_config_kwargs

    config = CONFIG_MAPPING["deepseek_v32"](**{**tiny_config_kwargs("deepseek_v32"), "index_topk": index_topk})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_sparse_indexer_selects_every_key_and_keeps_logits():
    model = _tiny_dsa()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        with apply_export_patches(model, None, ["sparse_attention_indexer"], max_seq_len=64) as applied:
            assert applied == ["sparse_attention_indexer"]
            indexer = model.model.layers[0].self_attn.indexer
            assert indexer.forward(torch.zeros(2, 9, 64)).shape == (2, 9, 9)
            torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)  # every key: the same mask
    assert "forward" not in vars(indexer)  # restored


def test_sparse_indexer_refuses_sequences_past_index_topk():
    from autodeploy.errors import ExportError

    model = _tiny_dsa(index_topk=32)
    with pytest.raises(ExportError, match="index_topk=32.*max_seq_len=64 must be <= 32"):
        with apply_export_patches(model, None, ["sparse_attention_indexer"], max_seq_len=64):
            pass


def test_sparse_indexer_does_not_apply_without_one():
    with apply_export_patches(torch.nn.Linear(2, 2), None, ["sparse_attention_indexer"]) as applied:
        assert applied == []


# -- moe_identity_experts (LongCat-Flash's zero-computation experts) ---------------------------------
def test_identity_experts_patch_keeps_logits_and_exports():
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from autodeploy.coverage import tiny_config_kwargs
    from helpers import export_hf

    config = CONFIG_MAPPING["longcat_flash"](**tiny_config_kwargs("longcat_flash"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    experts = model.model.layers[0].mlp.experts
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        picked = model.model.layers[0].mlp.router(model.model.embed_tokens(ids))[2]
        assert (picked >= experts.num_routed_experts).any()  # some tokens go to a zero-computation expert
        with apply_export_patches(model, None, ["moe_identity_experts"]) as applied:
            assert applied == ["moe_identity_experts"]
            torch.testing.assert_close(model(ids).logits, expected, atol=1e-6, rtol=1e-6)
        assert "forward" not in vars(experts)  # restored
        gm = export_hf(model)  # the data-dependent expert loop does not export without the patch
        torch.testing.assert_close(gm(ids, torch.arange(16).expand(3, 16))[0], expected, atol=1e-5, rtol=1e-5)

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

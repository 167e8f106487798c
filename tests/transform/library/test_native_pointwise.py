"""post_load_fusion: native_pointwise moves float32 RMSNorm (with the residual add before it), SiLU x up and RoPE
onto auto_deploy::rms_norm / add_rms_norm / silu_mul / rope: counts, logits against HF, what it leaves alone,
and the skip without the native kernels."""

import pytest
import torch

import autodeploy
from autodeploy.custom_ops import native
from autodeploy.transform import transform_history
from helpers import count, export_gm, num_matches, run_transform
from tiny_models import hf_reference, random_batch

aten = torch.ops.aten
ops = torch.ops.auto_deploy
needs_native = pytest.mark.skipif(not native.pointwise_available(), reason="needs the native kernels")


def _native_pointwise(gm):
    return run_transform("native_pointwise", gm, "post_load_fusion")


def _assert_logits_match_hf(gm, path, shapes):
    hf = hf_reference(path)
    for batch, seq in shapes:
        ids, pos = random_batch(batch, seq)
        with torch.no_grad():
            torch.testing.assert_close(gm(ids, pos)[0], hf(ids, position_ids=pos).logits, atol=1e-4, rtol=0)


@needs_native
def test_llama_pointwise_work_uses_the_native_ops_and_matches_hf(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    gm = _native_pointwise(autodeploy.optimize(path, until="weight_load"))
    layers = 2
    assert num_matches(gm, "native_pointwise") == 2 * layers + 1 + 2 * layers
    # every norm but the first (of the embeddings) follows a residual add
    assert count(gm, ops.add_rms_norm.default) == 2 * layers and count(gm, ops.rms_norm.default) == 1
    assert count(gm, ops.torch_rmsnorm.default) == 0
    assert count(gm, aten.add.Tensor) == 0  # the last layer's feeds the final norm
    assert count(gm, ops.silu_mul.default) == layers and count(gm, aten.silu.default) == 0
    assert count(gm, ops.rope.default) == layers and count(gm, ops.torch_rope_with_explicit_cos_sin.default) == 0
    _assert_logits_match_hf(gm, path, ((1, 1), (1, 7), (3, 9)))


class Mixed(torch.nn.Module):
    """RoPE in three forms (only the canonical rotate_half one in [b, s, h, d] is taken) and SiLU products
    of two shapes (a broadcast one stays)."""

    def forward(self, q, k, cos, sin, up, row):
        rotate_half = ops.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)
        interleaved = ops.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2, True)
        heads_first = ops.torch_rope_with_explicit_cos_sin(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1)
        gate = torch.nn.functional.silu(up)
        return *rotate_half, *interleaved, *heads_first, gate * up, gate * row


@needs_native
def test_only_the_forms_the_kernels_compute():
    torch.manual_seed(0)
    args = (torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8),
            torch.randn(1, 5, 16), torch.randn(16))
    gm = export_gm(Mixed(), *args)
    expected = gm(*args)
    gm = _native_pointwise(gm)
    assert count(gm, ops.rope.default) == 1 and count(gm, ops.torch_rope_with_explicit_cos_sin.default) == 2
    assert count(gm, ops.silu_mul.default) == 1 and count(gm, aten.silu.default) == 1  # the broadcast product's
    for out, ref in zip(gm(*args), expected):
        torch.testing.assert_close(out, ref)


def test_skipped_without_the_native_kernels(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(native, "pointwise_available", lambda: False)
    gm = _native_pointwise(autodeploy.optimize(tiny_checkpoint("llama"), until="weight_load"))
    assert transform_history(gm)["native_pointwise"].info.skipped
    assert count(gm, ops.rms_norm.default) == 0 and count(gm, ops.torch_rmsnorm.default) == 5


def test_bf16_models_are_left_alone(tiny_checkpoint):
    gm = autodeploy.optimize(tiny_checkpoint("llama"), until="weight_load", overrides={"dtype": "bfloat16"})
    gm = _native_pointwise(gm)
    assert transform_history(gm)["native_pointwise"].info.skipped
    assert count(gm, ops.rms_norm.default) == count(gm, ops.silu_mul.default) == count(gm, ops.rope.default) == 0


@needs_native
def test_normed_q_and_k_before_rope(tiny_checkpoint):
    """Qwen3 normalizes q and k per head before RoPE: the rope node's inputs are norms replaced before it."""
    path = tiny_checkpoint("qwen3")
    gm = _native_pointwise(autodeploy.optimize(path, until="weight_load"))
    norms = count(gm, ops.rms_norm.default) + count(gm, ops.add_rms_norm.default)
    assert count(gm, ops.rope.default) == 2 and norms == 2 * 2 + 2 * 2 + 1
    _assert_logits_match_hf(gm, path, ((2, 6),))

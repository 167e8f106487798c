"""pack_f32_weights: float32 products onto the native AVX-512 kernel's panel-packed layout, logits against HF within
1e-4, nothing left of the row-major weights, tied weights left by rows, fusion leaving packed products alone, and a
logged skip where no build packs."""

import logging

import pytest
import torch

import autodeploy
from autodeploy.custom_ops import native
from autodeploy.transform import transform_history
from helpers import count, run_transform
from tiny_models import hf_reference, random_batch

F32 = torch.ops.auto_deploy.f32_linear.default
PACKED = torch.ops.auto_deploy.f32_packed_linear.default
LAYERS = 2
FUSED = 4 * LAYERS + 1  # q/k/v and gate/up fused per layer; the head

needs_panels = pytest.mark.skipif(native.f32_pack_width() == 0,
                                  reason="the native kernels do not run here or their build reads no panels")


def _prepared(path):
    gm = autodeploy.optimize(path, until="weight_load")
    gm = run_transform("native_linear", gm, "post_load_fusion")
    return run_transform("fuse_gemms", gm, "post_load_fusion")


@needs_panels
def test_every_float32_product_is_packed_and_matches_hf(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    gm = _prepared(path)
    row_major = {n.args[1].target for n in gm.graph.find_nodes(op="call_function", target=F32)}
    gm = run_transform("pack_f32_weights", gm, "post_load_fusion")
    assert count(gm, F32) == 0 and count(gm, PACKED) == FUSED
    assert transform_history(gm)["pack_f32_weights"].info.num_matches == FUSED
    params = dict(gm.named_parameters())
    assert not row_major & set(params)  # the row-major weights are gone
    for node in gm.graph.find_nodes(op="call_function", target=PACKED):
        panels, out_features = params[node.args[1].target], node.args[2]
        assert panels.shape[2] == 16 and panels.shape[0] == -(-out_features // 16)
    hf = hf_reference(path)
    for batch, seq in ((1, 1), (4, 1), (1, 5), (3, 9)):  # decode rows, passes of one and two panels
        ids, pos = random_batch(batch, seq)
        with torch.no_grad():
            torch.testing.assert_close(gm(ids, pos)[0], hf(ids, position_ids=pos).logits, atol=1e-4, rtol=0)


@needs_panels
def test_a_tied_lm_head_stays_by_rows(tiny_checkpoint):
    gm = _prepared(tiny_checkpoint("llama", tie_word_embeddings=True))
    gm = run_transform("pack_f32_weights", gm, "post_load_fusion")
    assert count(gm, PACKED) == FUSED - 1 and count(gm, F32) == 1  # the head shares the embedding's table


@needs_panels
def test_fusion_leaves_packed_products_alone(tiny_checkpoint):
    gm = autodeploy.optimize(tiny_checkpoint("llama"), until="weight_load")
    gm = run_transform("native_linear", gm, "post_load_fusion")
    gm = run_transform("pack_f32_weights", gm, "post_load_fusion")
    packed = count(gm, PACKED)
    gm = run_transform("fuse_gemms", gm, "post_load_fusion")
    assert count(gm, PACKED) == packed == 7 * LAYERS + 1


def test_skipped_with_its_reason_where_no_build_packs(tiny_checkpoint, monkeypatch, caplog):
    if not native.f32_linear_available():
        pytest.skip("the native kernels do not run here")
    monkeypatch.setattr(native, "f32_pack_width", lambda: 0)
    gm = _prepared(tiny_checkpoint("llama"))
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        gm = run_transform("pack_f32_weights", gm, "post_load_fusion")
    assert count(gm, PACKED) == 0 and count(gm, F32) == FUSED
    assert "reads no float32 panels" in caplog.text

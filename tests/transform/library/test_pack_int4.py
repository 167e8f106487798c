"""pack_int4_weights: int4 products onto the native kernels' tile-packed layout where the build reads one, the same
logits (to the float32 rounding of another summation order), nothing left of the row-major weights, fusion leaving
packed products alone, and a logged skip where no build packs."""

import logging

import pytest
import torch

import autodeploy
from autodeploy.custom_ops import native
from autodeploy.transform import transform_history
from helpers import count, run_transform
from tiny_models import random_batch

INT4 = torch.ops.auto_deploy.int4_linear.default
PACKED = torch.ops.auto_deploy.int4_packed_linear.default
LAYERS = 2
FUSED = 4 * LAYERS + 1  # q/k/v and gate/up fused per layer; the head

needs_packing = pytest.mark.skipif(native.int4_pack_rows() == 0,
                                   reason="the native kernels do not run here or their build reads no packed layout")


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint):
    path = tiny_checkpoint("llama")

    def make():
        gm = autodeploy.optimize(path, until="weight_load")
        gm = run_transform("quantize_weights", gm, "post_load_fusion", dtype="int4")
        return run_transform("fuse_gemms", gm, "post_load_fusion")

    return make


def _logits(gm, ids, pos):
    with torch.no_grad():
        return gm(ids, pos)[0]


@needs_packing
def test_every_int4_product_is_packed_with_the_same_logits(quantized):
    gm = quantized()
    ids, pos = random_batch(2, 8, seed=7)
    before = _logits(gm, ids, pos)
    row_major = {n.args[1].target for n in gm.graph.find_nodes(op="call_function", target=INT4)}
    gm = run_transform("pack_int4_weights", gm, "post_load_fusion")
    assert count(gm, INT4) == 0 and count(gm, PACKED) == FUSED
    assert transform_history(gm)["pack_int4_weights"].info.num_matches == FUSED
    buffers = dict(gm.named_buffers())
    assert not row_major & set(buffers)  # the row-major copies are gone
    rows = native.int4_pack_rows()
    for node in gm.graph.find_nodes(op="call_function", target=PACKED):
        words, out_features = buffers[node.args[1].target], node.args[4]
        assert words.dtype == torch.int32 and words.shape[2] == rows and words.shape[0] == -(-out_features // rows)
    # 16 rows: the decode rows' integer sums in both, added in another order
    torch.testing.assert_close(_logits(gm, ids, pos), before, atol=1e-5, rtol=0)


@needs_packing
def test_fusion_leaves_packed_products_alone(tiny_checkpoint):
    gm = autodeploy.optimize(tiny_checkpoint("llama"), until="weight_load")
    gm = run_transform("quantize_weights", gm, "post_load_fusion", dtype="int4")
    gm = run_transform("pack_int4_weights", gm, "post_load_fusion")
    packed = count(gm, PACKED)
    gm = run_transform("fuse_gemms", gm, "post_load_fusion")
    assert count(gm, PACKED) == packed == 7 * LAYERS + 1


def test_skipped_with_its_reason_where_no_build_packs(quantized, monkeypatch, caplog):
    monkeypatch.setattr(native, "int4_pack_rows", lambda: 0)
    gm = quantized()
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        gm = run_transform("pack_int4_weights", gm, "post_load_fusion")
    assert count(gm, PACKED) == 0 and count(gm, INT4) == FUSED
    assert "reads no packed 4-bit layout" in caplog.text

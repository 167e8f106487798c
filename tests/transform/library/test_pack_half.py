"""pack_half_weights: 16-bit products onto the native AVX2 kernel's panels (run with the AVX2 build wherever this
CPU runs it), the same logits as the row-major half_linear graph to float32 rounding, nothing left of the
row-major weights, and a logged skip where no build packs (tied weights: pack_products, test_pack_f32.py)."""

import logging

import pytest
import torch

import autodeploy
from autodeploy.custom_ops import native
from autodeploy.transform import transform_history
from helpers import count, run_transform
from tiny_models import random_batch

HALF = torch.ops.auto_deploy.half_linear.default
PACKED = torch.ops.auto_deploy.half_packed_linear.default
LAYERS = 2
FUSED = 4 * LAYERS + 1  # q/k/v and gate/up fused per layer; the head


@pytest.fixture
def avx2_build():
    """The AVX2 build (the one that reads 16-bit panels) for the test, where this CPU runs it."""
    if native.library() is None or "AVX2" not in native.runnable_capabilities():
        pytest.skip("the AVX2 kernels do not run here")
    with native.use_kernels("AVX2"):
        yield


def _half(path, dtype="bf16"):
    gm = autodeploy.optimize(path, until="weight_load")
    gm = run_transform("quantize_weights", gm, "post_load_fusion", dtype=dtype)
    return run_transform("fuse_gemms", gm, "post_load_fusion")


def _logits(gm, ids, pos):
    with torch.no_grad():
        return gm(ids, pos)[0]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_every_16_bit_product_is_packed_and_computes_the_same(tiny_checkpoint, avx2_build, dtype):
    gm = _half(tiny_checkpoint("llama"), dtype)
    row_major = {n.args[1].target for n in gm.graph.find_nodes(op="call_function", target=HALF)}
    batches = [random_batch(batch, seq) for batch, seq in ((1, 1), (4, 1), (1, 5), (3, 9))]
    before = [_logits(gm, ids, pos) for ids, pos in batches]
    gm = run_transform("pack_half_weights", gm, "post_load_fusion")
    assert count(gm, HALF) == 0 and count(gm, PACKED) == FUSED
    assert transform_history(gm)["pack_half_weights"].info.num_matches == FUSED
    params = dict(gm.named_parameters())
    assert not row_major & set(params)  # the row-major weights are gone
    for node in gm.graph.find_nodes(op="call_function", target=PACKED):
        panels = params[node.args[1].target]
        assert panels.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype] and panels.shape[2] == 16
    for (ids, pos), expected in zip(batches, before):  # float32 sums in another order
        torch.testing.assert_close(_logits(gm, ids, pos), expected, atol=2e-5, rtol=0)


def test_skipped_with_its_reason_where_no_build_packs(tiny_checkpoint, monkeypatch, caplog):
    if native.library() is None:
        pytest.skip("the native kernels do not run here")
    monkeypatch.setattr(native, "half_pack_width", lambda: 0)
    gm = _half(tiny_checkpoint("llama"))
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        gm = run_transform("pack_half_weights", gm, "post_load_fusion")
    assert count(gm, PACKED) == 0 and count(gm, HALF) == FUSED
    assert "reads no 16-bit panels" in caplog.text

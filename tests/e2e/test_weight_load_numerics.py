"""End to end through the default pipeline (up to post_load_fusion): every attention, RoPE, RMSNorm
and MoE block is a canonical op (RMSNorm and RoPE then on the native kernels by ``native_pointwise`` where they
run, RMSNorm fused into aten.rms_norm by ``fuse_rmsnorm`` elsewhere), one export serves every shape, and logits
match HF within 1e-4."""

from collections import Counter

import pytest
import torch

import autodeploy
from autodeploy.custom_ops import native
from tiny_models import ARCHS, hf_reference, random_batch

pytestmark = pytest.mark.slow  # whole architectures end to end, logits against HF

SHAPES = [(1, 1), (1, 7), (3, 5), (4, 33)]
LAYERS = 2
MOE_ARCHS = {"mixtral", "qwen2_moe"}


def canonical_op_counts(gm: torch.fx.GraphModule) -> Counter:
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "auto_deploy":
            name = node.target._schema.name.split("::")[-1]
            name = "rms_norm" if name == "add_rms_norm" else name  # a norm with the residual add before it
            counts["torch_rope" if name.startswith("torch_rope") else name] += 1
        elif node.op == "call_function":
            counts[str(node.target)] += 1
    return counts


def expected_counts(arch: str) -> dict:
    norms = 2 * LAYERS + 1 + (2 * LAYERS if arch == "qwen3" else 0)  # qwen3: q/k norms per layer
    on_native = native.pointwise_available()  # native_pointwise's ops, else torch_rope and fuse_rmsnorm's aten op
    return {
        "torch_attention": LAYERS,
        "torch_rope": 0 if on_native else LAYERS,
        "rope": LAYERS if on_native else 0,
        "torch_rmsnorm": 0,  # all matched, then onto a fused kernel
        "rms_norm": norms if on_native else 0,
        "aten.rms_norm.default": 0 if on_native else norms,
        "torch_moe": LAYERS if arch in MOE_ARCHS else 0,
        "aten.scaled_dot_product_attention.default": 0,
        "aten.rsqrt.default": 0,
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_canonical_ops_and_logits_match_hf_at_several_shapes(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    gm = autodeploy.optimize(path, until="post_load_fusion")
    assert isinstance(gm, torch.fx.GraphModule)
    counts = canonical_op_counts(gm)
    assert {k: counts[k] for k in expected_counts(arch)} == expected_counts(arch)

    reference = hf_reference(path)
    for batch, seq in SHAPES:
        input_ids, position_ids = random_batch(batch, seq, seed=batch * 100 + seq)
        with torch.no_grad():
            logits = gm(input_ids, position_ids)[0]
            expected = reference(input_ids=input_ids, position_ids=position_ids).logits
        assert logits.shape == (batch, seq, reference.config.vocab_size)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)

"""post_load_fusion: fuse_gemms op counts before/after, freed originals, and logits against HF."""

import torch

import autodeploy
from autodeploy.transform import transform_history
from helpers import count, export_gm, run_transform
from tiny_models import hf_reference, random_batch

aten = torch.ops.aten


def _fuse_gemms(gm):
    return run_transform("fuse_gemms", gm, "post_load_fusion")


def _linears(gm) -> int:
    return count(gm, aten.linear.default)


def _weight_bytes(gm) -> int:
    return sum(p.numel() * p.element_size() for p in gm.parameters())


def test_fuse_gemms_llama_counts_and_numerics(tiny_checkpoint, capsys):
    path = tiny_checkpoint("llama")
    gm = autodeploy.optimize(path, until="weight_load")
    layers, linears_before, bytes_before = 2, _linears(gm), _weight_bytes(gm)
    capsys.readouterr()
    fused = _fuse_gemms(gm)
    # the originals' pages of the memory-mapped checkpoint are given back, not kept beside the fused copies
    assert "MiB of memory-mapped checkpoint pages released" in capsys.readouterr().err
    # per layer: q/k/v -> 1 and gate/up -> 1; o_proj, down_proj and lm_head unchanged
    assert linears_before == 7 * layers + 1
    assert _linears(fused) == 4 * layers + 1
    assert transform_history(fused)["fuse_gemms"].info.num_matches == 2 * layers
    names = dict(fused.named_parameters())
    assert not any(k in name for name in names for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    assert _weight_bytes(fused) == bytes_before  # the fused weights replace the originals
    hf = hf_reference(path)
    for batch, seq in ((1, 5), (3, 9)):
        ids, pos = random_batch(batch, seq)
        with torch.no_grad():
            ref = hf(ids, position_ids=pos).logits
            torch.testing.assert_close(fused(ids, pos)[0], ref, atol=1e-4, rtol=0)


class Projections(torch.nn.Module):
    def __init__(self, bias_c: bool):
        super().__init__()
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(8, 6)
        self.c = torch.nn.Linear(6, 5, bias=bias_c)  # reads a different input
        self.d = torch.nn.Linear(6, 5, bias=False)

    def forward(self, x):
        y = self.b(x)
        return self.a(x) * 2, self.c(y) + self.d(y)


def test_fuse_gemms_bias_and_mixed_bias():
    x = torch.randn(3, 8)
    for bias_c, expected_matches in ((False, 2), (True, 1)):  # c with bias + d without: left alone
        torch.manual_seed(0)
        gm = export_gm(Projections(bias_c), x, dims={0: torch.export.Dim("batch", min=1, max=16)})
        before = _linears(gm)
        expected = gm(x)
        gm = _fuse_gemms(gm)
        assert transform_history(gm)["fuse_gemms"].info.num_matches == expected_matches
        assert _linears(gm) == before - expected_matches
        for out, ref in zip(gm(x), expected):
            torch.testing.assert_close(out, ref)
        torch.testing.assert_close(gm(torch.randn(5, 8))[0].shape, torch.Size([5, 4]))


def _quantize(gm):
    return run_transform("quantize_weights", gm, "post_load_fusion")


def _int8_products(gm) -> list:
    return gm.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.torch_int8_linear.default)


def test_fuse_gemms_of_int8_weights_equals_quantizing_the_fused_weights(tiny_checkpoint):
    """After quantize_weights (the default order), q/k/v and gate/up int8 products fuse: their int8 weights
    and per-row scales are concatenated, bitwise what quantizing the fused fp32 weights gives (the order
    of the two transforms does not change the model), the originals are freed, and the logits are those of
    the unfused int8 graph."""
    path = tiny_checkpoint("llama")
    quantized = _quantize(autodeploy.optimize(path, until="weight_load"))
    assert len(_int8_products(quantized)) == 7 * 2 + 1
    ids, pos = random_batch(2, 7)
    with torch.no_grad():
        expected = quantized(ids, pos)[0]
    fused = _fuse_gemms(quantized)
    assert transform_history(fused)["fuse_gemms"].info.num_matches == 2 * 2
    assert len(_int8_products(fused)) == 4 * 2 + 1 and _linears(fused) == 0
    buffers = dict(fused.named_buffers())
    assert not any(k in name for name in buffers for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, pos)[0], expected, atol=1e-6, rtol=0)

    other_order = _quantize(_fuse_gemms(autodeploy.optimize(path, until="weight_load")))
    others = dict(other_order.named_buffers())
    for node in _int8_products(fused):
        weight, scale = node.args[1].target, node.args[2].target
        twin = next(n for n in _int8_products(other_order)
                    if others[n.args[1].target].shape == buffers[weight].shape
                    and torch.equal(others[n.args[1].target], buffers[weight]))
        assert torch.equal(others[twin.args[2].target], buffers[scale])

"""End to end up to weight_load: one export serves every shape, logits match HF within 1e-4."""

import pytest
import torch

import autodeploy
from tiny_models import ARCHS, hf_reference, random_batch

SHAPES = [(1, 1), (1, 7), (3, 5), (4, 33)]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf_at_several_shapes(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    gm = autodeploy.optimize(path, until="weight_load")
    assert isinstance(gm, torch.fx.GraphModule)
    reference = hf_reference(path)
    for batch, seq in SHAPES:
        input_ids, position_ids = random_batch(batch, seq, seed=batch * 100 + seq)
        with torch.no_grad():
            logits = gm(input_ids, position_ids)[0]
            expected = reference(input_ids=input_ids, position_ids=position_ids).logits
        assert logits.shape == (batch, seq, reference.config.vocab_size)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)

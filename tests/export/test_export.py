"""torch_export_to_gm: what torch.export needs from a model's forward."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutput

from autodeploy.export.export import torch_export_to_gm


class _UnprovableGuard(torch.nn.Module):
    """A reshape whose size check holds for every seq >= 1 but that the symbolic solver cannot prove over
    the seq range (the form of Aria's MoE: seq * min(64, 64 * seq) == 64 * seq)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)

    def forward(self, input_ids, position_ids=None, **kwargs):
        x = self.emb(input_ids)
        seq = x.shape[1]
        return CausalLMOutput(logits=x.reshape(x.shape[0], seq * min(64, 64 * seq) // 64, 8))


def test_a_guard_the_solver_cannot_prove_becomes_a_runtime_assert():
    model = _UnprovableGuard()
    gm = torch_export_to_gm(model, max_batch_size=4, max_seq_len=64)
    for batch, seq in ((1, 1), (2, 5), (4, 64)):
        ids = torch.randint(0, 16, (batch, seq))
        torch.testing.assert_close(gm(ids, torch.arange(seq).expand(batch, seq))[0], model.emb(ids))

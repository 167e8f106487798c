"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-MoE-DSA, A.X K2): the indexer selects every key.

The indexer scores the keys of each query and returns the ``index_topk`` best ones; the attention then masks
the others. ``topk(min(index_topk, kv_len))`` does not export (its guard ``min(2048, seq) <= seq`` is one the
symbolic shapes cannot prove), and while a sequence holds at most ``index_topk`` keys the selection is every key:
the sparse attention is the dense causal one. So during export the indexer returns all key indices, which the
model scatters into a mask that masks nothing, and the pattern matcher's dense causal attention is exact. Past
``index_topk`` keys it would not be: export refuses a ``max_seq_len`` above ``index_topk``.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch import nn

from ...errors import ExportError
from .registry import ExportPatch, ExportPatchRegistry


def _indexers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Indexer") and hasattr(m, "index_topk")]


def _every_key(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The [batch, seq, kv_len] int32 indices of every key (no cache during export: kv_len == seq)."""
    batch, seq = hidden_states.shape[:2]
    return torch.arange(seq, device=hidden_states.device, dtype=torch.int32).expand(batch, seq, seq)


@ExportPatchRegistry.register("sparse_attention_indexer")
class SparseAttentionIndexer(ExportPatch):
    def applies(self) -> bool:
        return bool(_indexers(self.model))

    @contextlib.contextmanager
    def patch(self):
        indexers = _indexers(self.model)
        topk = min(int(m.index_topk) for m in indexers)
        if self.max_seq_len is not None and self.max_seq_len > topk:
            raise ExportError(
                f"{type(self.model).__name__} uses sparse attention over its index_topk={topk} best keys, which "
                f"autodeploy runs as dense attention: exact only for sequences of at most {topk} tokens, so "
                f"max_seq_len={self.max_seq_len} must be <= {topk}"
            )
        with contextlib.ExitStack() as stack:
            for module in indexers:
                stack.enter_context(mock.patch.object(module, "forward", _every_key))
            yield

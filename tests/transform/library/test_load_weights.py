"""load_weights: the token-embedding table, read a few rows per token, is marked as read at random in the
checkpoint's mapping; the weights read whole (the LM head) keep the kernel's read-ahead."""

import sys

import pytest
import torch

import autodeploy
from autodeploy.utils.fx import get_attr_tensor
from proc_maps import vm_flags

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _embedding_table(gm) -> torch.Tensor:
    (lookup,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default)
    return get_attr_tensor(gm, lookup.args[0].target)


def test_embedding_table_is_marked_random_access(tiny_checkpoint):
    gm = autodeploy.optimize(tiny_checkpoint("llama"), until="weight_load")
    embedding = _embedding_table(gm)
    lm_head = get_attr_tensor(gm, "lm_head.weight")
    assert "rr" in vm_flags(embedding.data_ptr())
    assert "rr" not in vm_flags(lm_head.data_ptr())


def test_tied_table_keeps_read_ahead(tiny_checkpoint):
    gm = autodeploy.optimize(tiny_checkpoint("llama", tie_word_embeddings=True), until="weight_load")
    table = _embedding_table(gm)
    assert table.data_ptr() == get_attr_tensor(gm, "lm_head.weight").data_ptr()
    assert "rr" not in vm_flags(table.data_ptr())

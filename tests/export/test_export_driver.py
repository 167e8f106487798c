"""The export driver: a model's own no_grad blocks leave no grad-mode submodules in the graph."""

import types

import torch

from autodeploy.export.export import torch_export_to_gm


class NoGradBlock(torch.nn.Module):
    """Embedding, a linear under ``torch.no_grad()`` (as HRM's reasoning cycles), an LM head."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=16)
        self.embed, self.mid, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)

    def forward(self, input_ids, position_ids, use_cache=False):
        h = self.embed(input_ids)
        with torch.no_grad():
            h = self.mid(h)
        return types.SimpleNamespace(logits=self.head(h))


def test_no_grad_blocks_export_inline():
    torch.manual_seed(0)
    model = NoGradBlock().eval()
    gm = torch_export_to_gm(model, max_batch_size=4, max_seq_len=16)
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.wrap_with_set_grad_enabled)
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("submod")]
    ids = torch.randint(0, 16, (3, 5))
    pos = torch.arange(5).expand(3, 5)
    torch.testing.assert_close(gm(ids, pos)[0], model(ids, pos).logits)

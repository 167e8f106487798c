"""gather_logits_before_lm_head, through_last_layer: the logits' selection moved up through the row-wise ops
before the LM head (the last layer's output projection, MLP, norms and residual adds), never through attention
or an op that mixes tokens, nor past a value some other op reads in full; the uncached model is the oracle for
prompts, decode steps, chunked prefill and all-token logits."""

import pytest
import torch
from torch import nn

from autodeploy.runtime import PagePool, SequenceInfo
from autodeploy.transform import PipelineContext
from autodeploy.transform.library.gather_logits import select_rows_early
from autodeploy.utils.fx import add_placeholder, fake_input, graph_fake_mode
from helpers import ToyLM, export_gm, export_toy_lm, run_transform

aten = torch.ops.aten
SELECT, LINEAR = aten.index_select.default, aten.linear.default
CACHED_ATTENTION = torch.ops.auto_deploy.torch_cached_attention.default
TOL = dict(atol=1e-5, rtol=1e-5)
# _Rows: after the residual sum, the view, the scale, the reshape back, the cast, the norm and the last scale;
# before it, the two products, the ReLU and the sum itself
MOVED_AFTER_THE_SUM, MOVED_IN_ALL = 6, 10


def _cached(model, through_last_layer=True):
    ctx = PipelineContext(max_batch_size=4, max_seq_len=32)
    gm = run_transform("insert_cached_attention", export_toy_lm(model), "cache_init", ctx, page_size=4)
    gm = run_transform("gather_logits_before_lm_head", gm, "cache_init", ctx, through_last_layer=through_last_layer)
    gm = run_transform("initialize_cache", gm, "cache_init", ctx, num_pages=24)
    return gm, SequenceInfo.from_spec(gm.meta["kv_cache"])


def _on_selected_rows(gm) -> set:
    """The nodes computed from selected rows: the selections and everything after them."""
    after = set()
    for node in gm.graph.nodes:
        if node.target is SELECT or any(i in after for i in node.all_input_nodes):
            after.add(node)
    return after


def _oracle(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0][0]


def test_the_last_layer_after_attention_runs_on_the_selected_tokens():
    torch.manual_seed(0)
    gm, _ = _cached(ToyLM().eval())
    linears = list(gm.graph.find_nodes(op="call_function", target=LINEAR))
    after = _on_selected_rows(gm)
    assert len(linears) == 6 * ToyLM.LAYERS + 1
    # the last layer's output projection, its MLP's two products and the head; not its q/k/v
    assert [n for n in linears if n in after] == linears[-4:]
    assert not any(n.target is CACHED_ATTENTION for n in after)
    # two selections: the attention's output and the residual stream before the last layer
    selections = gm.graph.find_nodes(op="call_function", target=SELECT)
    assert len(selections) == 2
    assert {s.args[0].target for s in selections} == {aten.reshape.default, aten.add.Tensor}


@pytest.mark.parametrize("layout, softcap", [("bsnd", None), ("bnsd", 5.0)])
def test_logits_equal_the_uncached_model(layout, softcap):
    """Prompts of several sequences, decode steps, a chunked prefill beside a decode, and all-token logits."""
    torch.manual_seed(1)
    model = ToyLM(layout=layout, softcap=softcap).eval()
    gm, info = _cached(model)
    pool = PagePool(info.num_pages)
    seqs = [[3, 9, 4, 1, 7], [11, 2], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    pages = [pool.allocate(info.pages_needed(len(s) + 4)) for s in seqs]
    with torch.no_grad():
        logits = gm(**info.build([(s, 0, pg) for s, pg in zip(seqs, pages)]).as_kwargs())[0]
        for _step in range(3):
            for i, s in enumerate(seqs):
                torch.testing.assert_close(logits[0, i], _oracle(model, s)[-1], **TOL)
                s.append(int(logits[0, i].argmax()))
            logits = gm(**info.build([([s[-1]], len(s) - 1, pg) for s, pg in zip(seqs, pages)]).as_kwargs())[0]
        # a prompt in two chunks, the second beside a decode step, every token's logits
        prompt, chunk_pages = [20, 21, 22, 23, 24, 25, 26], pool.allocate(2)
        gm(**info.build([(prompt[:3], 0, chunk_pages)]).as_kwargs())
        batch = info.build([(prompt[3:], 3, chunk_pages), ([seqs[0][-1]], len(seqs[0]) - 1, pages[0])], gather="all")
        logits = gm(**batch.as_kwargs())[0]
    torch.testing.assert_close(logits[0, :4], _oracle(model, prompt)[3:], **TOL)
    torch.testing.assert_close(logits[0, 4], _oracle(model, seqs[0])[-1], **TOL)


class _Rows(nn.Module):
    """Row-wise ops (products, ReLU, a residual add, a reshape of each token's row and back, a cast to the
    input's type, an RMSNorm, a scale), with a mean over the tokens (``mix``) that no selection may cross."""

    def __init__(self, mix: bool):
        super().__init__()
        self.up, self.down, self.mix = nn.Linear(8, 16), nn.Linear(16, 8), mix
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(8))

    def forward(self, x):
        h = x + self.down(torch.relu(self.up(x)))
        b, s, _ = h.shape
        h = (h.view(b, s, 2, 4) * 1.5).reshape(b, s, 8).type_as(x)
        if self.mix:
            h = h - h.mean(1, keepdim=True)
        return torch.ops.auto_deploy.torch_rmsnorm(h, self.weight, 1e-6) * 2.0


def _selected_graph(model, return_the_sum: bool = False):
    """``model`` exported over [batch, seq, 8], its output's rows selected by a new input ``idx`` (and, with
    ``return_the_sum``, the residual sum returned too, every row); the selection then moved up. Returns the graph
    and how many ops the selection moved through."""
    dims = {0: torch.export.Dim("batch", max=8), 1: torch.export.Dim("seq", max=64)}
    gm = export_gm(model, torch.randn(2, 5, 8), dims=dims, cleanup=["cleanup_input_constraints"])
    idx = add_placeholder(gm, "idx", fake_input(graph_fake_mode(gm), "idx", ("n",), torch.long))
    output = gm.graph.output_node()
    (out,) = output.args[0]
    with gm.graph.inserting_before(output):
        selection = gm.graph.call_function(SELECT, (out, 1, idx))
    residual_sum = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    output.args = ((selection, residual_sum) if return_the_sum else (selection,),)
    moved = select_rows_early(gm, selection)
    gm.graph.lint()
    gm.recompile()
    return gm, moved


@pytest.mark.parametrize("mix", [False, True])
def test_selection_stops_at_ops_that_mix_tokens(mix):
    torch.manual_seed(2)
    model = _Rows(mix).eval()
    gm, moved = _selected_graph(model)
    (selection,) = gm.graph.find_nodes(op="call_function", target=SELECT)
    if mix:  # through the scale, the norm and the subtraction: the value before them is read in full by the mean
        assert moved == 3 and aten.mean.dim in {u.target for u in selection.args[0].users}
    else:  # through every op, the reshapes included: the input's rows are selected
        assert selection.args[0].op == "placeholder" and moved == MOVED_IN_ALL
    x, idx = torch.randn(3, 7, 8), torch.tensor([6, 0, 3])
    with torch.no_grad():
        torch.testing.assert_close(gm(x, idx)[0], model(x)[:, idx], **TOL)


def test_a_result_read_in_full_elsewhere_keeps_its_op():
    """The graph also returns the MLP's sum for every token: the ops before it keep every row."""
    torch.manual_seed(3)
    model = _Rows(False).eval()
    gm, moved = _selected_graph(model, return_the_sum=True)
    (selection,) = gm.graph.find_nodes(op="call_function", target=SELECT)
    assert selection.args[0].target is aten.add.Tensor and selection.args[0] in gm.graph.output_node().args[0]
    assert moved == MOVED_AFTER_THE_SUM
    x, idx = torch.randn(2, 6, 8), torch.tensor([5, 1])
    with torch.no_grad():
        got, full = gm(x, idx)
        torch.testing.assert_close(got, model(x)[:, idx], **TOL)
        torch.testing.assert_close(full, x + model.down(torch.relu(model.up(x))), **TOL)

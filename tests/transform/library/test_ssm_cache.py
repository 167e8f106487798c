"""cache_init: insert_cached_ssm on a tiny Mamba (the pipeline up to post_load_fusion): op counts, the calling
convention, the state cache in the spec and its budget; the uncached graph is the oracle."""

import pytest
import torch

from autodeploy import optimize
from autodeploy.coverage import make_checkpoint
from autodeploy.errors import AutoDeployError
from autodeploy.runtime import SequenceInfo
from autodeploy.runtime import kv_cache as kvc
from autodeploy.runtime.sequence_info import SLOT_IDX
from autodeploy.transform import PipelineContext, transform_history
from autodeploy.utils.fx import run_shape_prop
from helpers import count, run_transform

ops = torch.ops.auto_deploy
MAX_BATCH, MAX_SEQ, PAGE, LAYERS = 2, 32, 8, 2
INNER, STATE, KERNEL = 96, 16, 4  # the coverage sizes: intermediate_size 96; MambaConfig: state 16, conv 4


@pytest.fixture(scope="module")
def uncached(tmp_path_factory):
    path = make_checkpoint("mamba", tmp_path_factory.mktemp("ckpt") / "mamba")
    return optimize(path, until="post_load_fusion")


def _ctx():
    return PipelineContext(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ)


def _cached(uncached, ctx=None):
    import copy

    gm, ctx = copy.deepcopy(uncached), ctx or _ctx()
    gm = run_transform("insert_cached_attention", gm, "cache_init", ctx)  # no attention: skipped
    gm = run_transform("insert_cached_ssm", gm, "cache_init", ctx, page_size=PAGE)
    gm = run_transform("gather_logits_before_lm_head", gm, "cache_init", ctx)
    return gm, ctx


def test_insert_rewrites_the_ops_and_adds_the_state_cache(uncached):
    assert count(uncached, ops.torch_selective_scan.default) == count(uncached, ops.torch_causal_conv1d.default) == 2
    gm, ctx = _cached(uncached)
    assert transform_history(gm)["insert_cached_attention"].info.skipped
    assert transform_history(gm)["insert_cached_ssm"].info.num_matches == 2 * LAYERS
    assert count(gm, ops.torch_selective_scan.default) == count(gm, ops.torch_causal_conv1d.default) == 0
    assert count(gm, ops.torch_cached_selective_scan.default) == count(gm, ops.torch_cached_causal_conv1d.default) == 2
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == [
        "input_ids", "position_ids", "seq_lens", "input_pos", "page_table", SLOT_IDX, "logits_idx"]
    spec = gm.meta["kv_cache"]
    assert spec is ctx.extras["kv_cache"] and not spec.layers and spec.page_size == PAGE
    shapes = sorted((layer.shape, layer.dtype) for layer in spec.state_layers)
    assert shapes == sorted([((INNER, KERNEL - 1), torch.float32)] * 2 + [((INNER, STATE), torch.float32)] * 2)
    assert spec.state_nbytes == MAX_BATCH * 2 * INNER * (KERNEL - 1 + STATE) * 4
    assert spec.bytes_per_page == 0 and spec.nbytes() == 0  # nothing allocated yet
    run_shape_prop(gm)  # the new input carries a fake value: shapes propagate symbolically
    gm = run_transform("initialize_cache", gm, "cache_init", ctx)
    assert all(t.shape[0] == MAX_BATCH and not t.is_meta and not t.any() for t in kvc.cache_tensors(gm, spec))
    assert spec.nbytes() == spec.state_nbytes


def test_cached_graph_matches_the_uncached_graph_prefill_then_decode(uncached):
    gm, ctx = _cached(uncached)
    gm = run_transform("initialize_cache", gm, "cache_init", ctx)
    info = SequenceInfo.from_spec(gm.meta["kv_cache"])
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 3)]
    slots = [1, 0]

    def oracle(tokens):
        with torch.no_grad():
            return uncached(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0][0, -1]

    batch = info.build([((s), 0, [i], False, slot) for i, (s, slot) in enumerate(zip(seqs, slots))], slots=True)
    with torch.no_grad():
        logits = gm(*batch.as_args())[0][0]
    for row, s in zip(logits, seqs):
        torch.testing.assert_close(row, oracle(s), atol=1e-5, rtol=1e-5)
    for step in range(3):
        nxt = [s + [(7 * step + i) % 128] for i, s in enumerate(seqs)]
        batch = info.build([(n[-1:], len(s), [i], False, slot) for i, (s, n, slot) in enumerate(zip(seqs, nxt, slots))],
                           slots=True)
        with torch.no_grad():
            logits = gm(*batch.as_args())[0][0]
        for row, n in zip(logits, nxt):
            torch.testing.assert_close(row, oracle(n), atol=1e-5, rtol=1e-5)
        seqs = nxt


def test_the_budget_counts_the_state_cache(uncached):
    gm, ctx = _cached(uncached)
    spec = gm.meta["kv_cache"]
    gm = run_transform("resize_kv_cache", gm, "cache_init", ctx, free_memory_fraction=None, max_tokens=4 * PAGE)
    assert spec.num_pages == 4 and spec.nbytes() == spec.state_nbytes  # pages without attention cost nothing
    with pytest.raises(AutoDeployError, match="state cache"):  # a budget below the state cache holds nothing
        run_transform("resize_kv_cache", gm, "cache_init", ctx, free_memory_fraction=1e-12, max_tokens=None)


def test_graphs_without_state_space_ops_are_left_alone():
    from helpers import ToyLM, export_toy_lm

    gm, ctx = export_toy_lm(ToyLM().eval()), _ctx()
    gm = run_transform("insert_cached_ssm", gm, "cache_init", ctx)
    assert transform_history(gm)["insert_cached_ssm"].info.skipped and "kv_cache" not in gm.meta

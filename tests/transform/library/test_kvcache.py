"""cache_init: insert_cached_attention / initialize_cache / resize_kv_cache on a tiny hand-written decoder
whose exported graph already holds torch_attention; the eager (uncached) model is the oracle."""

import pytest
import torch
from torch import nn

from autodeploy.errors import AutoDeployError
from autodeploy.runtime import PagePool, SequenceInfo
from autodeploy.runtime import kv_cache as kvc
from autodeploy.runtime.sequence_info import GRAPH_INPUTS
from autodeploy.transform import PipelineContext, transform_history
from autodeploy.utils.fx import run_shape_prop
from helpers import ToyLM, count, export_toy_lm, run_transform

aten = torch.ops.aten
VOCAB, HIDDEN, N_HEADS, N_KV, LAYERS, PAGE = ToyLM.VOCAB, ToyLM.HIDDEN, ToyLM.N_HEADS, ToyLM.N_KV, ToyLM.LAYERS, 4
MAX_BATCH, MAX_SEQ = 4, 32
TOL = dict(atol=1e-5, rtol=1e-5)


def _ctx():
    return PipelineContext(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ)


def _cached(model, num_pages=24, gather_logits=True, through_last_layer=True, **fields):
    gm, ctx = export_toy_lm(model), _ctx()
    gm = run_transform("insert_cached_attention", gm, "cache_init", ctx, page_size=PAGE, **fields)
    if gather_logits:
        gm = run_transform("gather_logits_before_lm_head", gm, "cache_init", ctx,
                           through_last_layer=through_last_layer)
    gm = run_transform("initialize_cache", gm, "cache_init", ctx, num_pages=num_pages)
    return gm, SequenceInfo.from_spec(gm.meta["kv_cache"])


def _oracle_last(model, tokens):
    """Uncached logits of the last token of ``tokens``."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0][0, -1]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ToyLM().eval()


def test_insert_rewrites_graph_and_calling_convention(model):
    gm, ctx = export_toy_lm(model), _ctx()
    assert count(gm, torch.ops.auto_deploy.torch_attention.default) == LAYERS
    gm = run_transform("insert_cached_attention", gm, "cache_init", ctx, page_size=PAGE)
    info = transform_history(gm)["insert_cached_attention"].info
    assert info.num_matches == LAYERS and not info.skipped
    assert count(gm, torch.ops.auto_deploy.torch_attention.default) == 0
    assert count(gm, torch.ops.auto_deploy.torch_cached_attention.default) == LAYERS
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == list(GRAPH_INPUTS[:-1])
    assert not gm.graph.find_nodes(op="call_function", target=aten.index_select.default)
    gm = run_transform("gather_logits_before_lm_head", gm, "cache_init", ctx, through_last_layer=False)
    assert transform_history(gm)["gather_logits_before_lm_head"].info.num_matches == 1
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == list(GRAPH_INPUTS)
    (select,) = gm.graph.find_nodes(op="call_function", target=aten.index_select.default)
    assert [u.target for u in select.users] == [aten.linear.default]  # gathered before the LM head
    spec = gm.meta["kv_cache"]
    assert spec is ctx.extras["kv_cache"] and spec.num_pages == 0 and len(spec.layers) == LAYERS
    assert spec.bytes_per_token == LAYERS * 2 * N_KV * (HIDDEN // N_HEADS) * 4
    assert all(b.is_meta for b in kvc.cache_tensors(gm, spec))
    assert "kv_cache_k_0" not in gm.state_dict()  # caches are non-persistent buffers
    run_shape_prop(gm)  # new placeholders carry fake values: shapes propagate symbolically
    out_val = gm.graph.output_node().args[0][0].meta["val"]
    assert out_val.shape[-1] == VOCAB and not isinstance(out_val.shape[1], int)


def test_prefill_then_decode_batch_matches_uncached(model):
    gm, info = _cached(model)
    pool = PagePool(info.num_pages)
    prompts = [[3, 9, 4, 1, 7], [11, 2], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    seqs = [list(p) for p in prompts]
    pages = [pool.allocate(info.pages_needed(len(p) + 6)) for p in prompts]
    logits = gm(**info.build([(s, 0, pg) for s, pg in zip(seqs, pages)]).as_kwargs())[0]
    assert logits.shape == (1, len(prompts), VOCAB)
    for _step in range(6):
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[0, i], _oracle_last(model, s), **TOL)
            s.append(int(logits[0, i].argmax()))
        batch = info.build([([s[-1]], len(s) - 1, pg) for s, pg in zip(seqs, pages)])
        logits = gm(**batch.as_kwargs())[0]


def test_mixed_prefill_decode_and_page_reuse(model):
    gm, info = _cached(model, num_pages=6)
    pool = PagePool(info.num_pages)
    a, b = [1, 2, 3, 4, 5, 6, 7], [8, 9, 10]
    pa, pb = pool.allocate(3), pool.allocate(2)
    gm(**info.build([(a, 0, pa), (b, 0, pb)]).as_kwargs())
    pool.free(pa)  # a finishes; its pages (stale k/v inside) go to c
    c = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    pc = pool.allocate(3)
    assert set(pc) == set(pa)
    b.append(30)
    # one forward: b decodes, c prefills its first 6 tokens on reused pages
    logits = gm(**info.build([([30], 3, pb), (c[:6], 0, pc)]).as_kwargs())[0]
    torch.testing.assert_close(logits[0, 0], _oracle_last(model, b), **TOL)
    torch.testing.assert_close(logits[0, 1], _oracle_last(model, c[:6]), **TOL)
    # chunked prefill: the rest of c after its cached prefix, together with b's next decode
    b.append(31)
    logits = gm(**info.build([(c[6:], 6, pc), ([31], 4, pb)]).as_kwargs())[0]
    torch.testing.assert_close(logits[0, 0], _oracle_last(model, c), **TOL)
    torch.testing.assert_close(logits[0, 1], _oracle_last(model, b), **TOL)


def test_all_logits_and_no_gather(model):
    tokens = [4, 8, 15, 16, 23, 42]
    with torch.no_grad():
        ref = model(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0]
    gm, info = _cached(model)
    out = gm(**info.build([(tokens, 0, [0, 1])], gather="all").as_kwargs())[0]
    torch.testing.assert_close(out, ref, **TOL)
    gm, info = _cached(model, gather_logits=False)
    assert "logits_idx" not in [n.name for n in gm.graph.find_nodes(op="placeholder")]
    out = gm(*info.build([(tokens, 0, [2, 3])], gather=None).as_args())[0]
    torch.testing.assert_close(out, ref, **TOL)


def test_bnsd_layout_and_softcap_gather():
    torch.manual_seed(1)
    model = ToyLM(layout="bnsd", softcap=5.0).eval()
    gm, info = _cached(model, through_last_layer=False)  # the selection as placed (test_gather_logits.py moves it)
    (select,) = gm.graph.find_nodes(op="call_function", target=aten.index_select.default)
    assert [u.target for u in select.users] == [aten.linear.default]  # through the soft-cap's div/tanh/mul
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    logits = gm(**info.build([(s, 0, [2 * i, 2 * i + 1]) for i, s in enumerate(seqs)]).as_kwargs())[0]
    for _step in range(2):
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[0, i], _oracle_last(model, s), **TOL)
            s.append(int(logits[0, i].argmax()))
        batch = info.build([([s[-1]], len(s) - 1, [2 * i, 2 * i + 1]) for i, s in enumerate(seqs)])
        logits = gm(**batch.as_kwargs())[0]


def test_gather_before_an_int8_lm_head(model):
    """With quantize_weights (post_load_fusion, before this stage) the LM head is an int8 linear: the
    logits are still gathered before it, so a prompt computes the head for its last token only."""
    gm, ctx = export_toy_lm(model), _ctx()
    gm = run_transform("quantize_weights", gm, "post_load_fusion", ctx)
    tokens = [4, 8, 15, 16, 23, 42]
    with torch.no_grad():
        want = gm(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0][0, -1]
    gm = run_transform("insert_cached_attention", gm, "cache_init", ctx, page_size=PAGE)
    gm = run_transform("gather_logits_before_lm_head", gm, "cache_init", ctx, through_last_layer=False)
    gm = run_transform("initialize_cache", gm, "cache_init", ctx, num_pages=8)
    (select,) = gm.graph.find_nodes(op="call_function", target=aten.index_select.default)
    assert [u.target for u in select.users] == [torch.ops.auto_deploy.torch_int8_linear.default]
    info = SequenceInfo.from_spec(gm.meta["kv_cache"])
    with torch.no_grad():
        logits = gm(**info.build([(tokens, 0, [0, 1])]).as_kwargs())[0]
    assert logits.shape == (1, 1, VOCAB)
    torch.testing.assert_close(logits[0, 0], want, **TOL)


def test_no_attention_is_skipped_and_unknown_backend():
    class NoAttn(nn.Module):
        def forward(self, input_ids, position_ids):
            return (input_ids.float() * 2,)

    gm = run_transform("insert_cached_attention", export_toy_lm(NoAttn()), "cache_init", _ctx())
    assert transform_history(gm)["insert_cached_attention"].info.skipped and "kv_cache" not in gm.meta
    gm = run_transform("initialize_cache", gm, "cache_init", _ctx())
    assert transform_history(gm)["initialize_cache"].info.skipped
    with pytest.raises(AutoDeployError, match="unknown attention backend"):
        torch.manual_seed(0)
        run_transform("insert_cached_attention", export_toy_lm(ToyLM()), "cache_init", _ctx(), backend="nope")


def _cache_bytes(gm):
    return sum(t.numel() * t.element_size() for t in kvc.cache_tensors(gm, gm.meta["kv_cache"]))


def test_initialize_default_and_resize_within_budget(model, monkeypatch):
    gm, ctx = export_toy_lm(model), _ctx()
    gm = run_transform("insert_cached_attention", gm, "cache_init", ctx, page_size=PAGE)
    gm = run_transform("gather_logits_before_lm_head", gm, "cache_init", ctx)
    gm = run_transform("initialize_cache", gm, "cache_init", ctx)
    spec = gm.meta["kv_cache"]
    assert spec.num_pages == MAX_BATCH * MAX_SEQ // PAGE == spec.max_useful_pages
    assert _cache_bytes(gm) == spec.nbytes() and all(t.device.type == "cpu" for t in kvc.cache_tensors(gm, spec))

    per_page = spec.bytes_per_page  # 4 tokens x 2 layers x (k+v) x 2 heads x 8 dims x 4 bytes = 1 KiB
    total = 10 * per_page + 500  # free memory + the current caches (which a resize releases first)
    monkeypatch.setattr(kvc, "available_memory_bytes", lambda device: total - _cache_bytes(gm))
    gm = run_transform("resize_kv_cache", gm, "cache_init", ctx, free_memory_fraction=0.5)  # budget 5.25 pages -> 5
    assert spec.num_pages == 5 and _cache_bytes(gm) <= 0.5 * total
    # 13 tokens -> 3 pages
    gm = run_transform("resize_kv_cache", gm, "cache_init", ctx, free_memory_fraction=1.0, max_tokens=13)
    assert spec.num_pages == 3 and spec.max_tokens <= 13 and _cache_bytes(gm) == 3 * per_page
    # capped: max_useful_pages
    gm = run_transform("resize_kv_cache", gm, "cache_init", ctx, free_memory_fraction=None, max_tokens=10_000)
    assert spec.num_pages == spec.max_useful_pages
    with pytest.raises(AutoDeployError, match="holds no KV-cache page"):
        run_transform("resize_kv_cache", gm, "cache_init", ctx, free_memory_fraction=None, max_tokens=PAGE - 1)
    assert spec.num_pages == spec.max_useful_pages  # a failed resize leaves the caches as they were
    monkeypatch.setattr(kvc, "available_memory_bytes", lambda device: 0)
    with pytest.raises(AutoDeployError, match="over its budget"):  # initialize never goes above free memory
        run_transform("initialize_cache", gm, "cache_init", ctx, num_pages=spec.max_useful_pages + 1)

    # the resized cache still computes the same logits
    gm = run_transform("resize_kv_cache", gm, "cache_init", ctx, free_memory_fraction=None, max_tokens=3 * PAGE)
    info = SequenceInfo.from_spec(spec)
    tokens = [5, 4, 3, 2, 1, 0, 9, 8, 7, 6]
    out = gm(**info.build([(tokens, 0, [2, 0, 1])]).as_kwargs())[0]
    torch.testing.assert_close(out[0, 0], _oracle_last(model, tokens), **TOL)


def test_allocate_refuses_over_budget(model):
    gm, ctx = export_toy_lm(model), _ctx()
    gm = run_transform("insert_cached_attention", gm, "cache_init", ctx, page_size=PAGE)
    spec = gm.meta["kv_cache"]
    with pytest.raises(AutoDeployError, match="over its budget"):
        kvc.allocate_kv_caches(gm, spec, 4, "cpu", budget_bytes=4 * spec.bytes_per_page - 1)
    assert spec.num_pages == 0 and all(t.is_meta for t in kvc.cache_tensors(gm, spec))


def test_yaml_entries_through_the_optimizer(model):
    from autodeploy.config.loader import AutoDeployConfig
    from autodeploy.transform import InferenceOptimizer

    config = AutoDeployConfig(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, transforms={
        "insert_cached_attention": {"stage": "cache_init", "backend": "torch", "page_size": 8},
        "gather_logits_before_lm_head": {"stage": "cache_init"},
        "initialize_cache": {"stage": "cache_init", "num_pages": None},
        "resize_kv_cache": {"stage": "cache_init", "free_memory_fraction": 0.9, "max_tokens": 40},
    })
    gm = InferenceOptimizer(config)(export_toy_lm(model))
    spec = gm.meta["kv_cache"]
    assert (spec.page_size, spec.num_pages) == (8, 5)
    info = SequenceInfo.from_spec(spec)
    tokens = list(range(1, 12))
    out = gm(**info.build([(tokens, 0, [4, 1])]).as_kwargs())[0]
    torch.testing.assert_close(out[0, 0], _oracle_last(model, tokens), **TOL)

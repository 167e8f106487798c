"""cache_init: insert_cached_attention / initialize_cache / resize_kv_cache on a tiny hand-written decoder
whose exported graph already holds torch_attention; the eager (uncached) model is the oracle."""

import pytest
import torch
from torch import nn

import autodeploy.custom_ops.attention  # noqa: F401
from autodeploy.errors import AutoDeployError
from autodeploy.export.export import _flatten_io
from autodeploy.runtime import PagePool, SequenceInfo
from autodeploy.runtime import kv_cache as kvc
from autodeploy.runtime.sequence_info import GRAPH_INPUTS
from autodeploy.transform import PipelineContext, TransformRegistry, transform_history
from autodeploy.utils.fx import run_shape_prop

aten = torch.ops.aten
VOCAB, HIDDEN, N_HEADS, N_KV, LAYERS, PAGE = 64, 32, 4, 2, 2, 4
MAX_BATCH, MAX_SEQ = 4, 32
TOL = dict(atol=1e-5, rtol=1e-5)


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class Layer(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.q = nn.Linear(HIDDEN, N_HEADS * head_dim, bias=False)
        self.k = nn.Linear(HIDDEN, N_KV * head_dim, bias=False)
        self.v = nn.Linear(HIDDEN, N_KV * head_dim, bias=False)
        self.o = nn.Linear(N_HEADS * head_dim, HIDDEN, bias=False)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.n1 = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.n2 = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))


class TinyDecoder(nn.Module):
    """Embedding, LAYERS x (RMSNorm, GQA attention with RoPE, MLP), final norm, LM head (+ soft-cap)."""

    def __init__(self, layout="bsnd", softcap=None):
        super().__init__()
        self.layout, self.softcap, self.head_dim = layout, softcap, HIDDEN // N_HEADS
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer(self.head_dim) for _ in range(LAYERS))
        self.norm = nn.Parameter(torch.ones(HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def _rope(self, x, cos, sin):  # x [b, s, n, d]
        x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        h = self.embed(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)[:, :, None, :]
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            x = _rms(h, layer.n1)
            q = self._rope(layer.q(x).view(b, s, N_HEADS, self.head_dim), cos, sin)
            k = self._rope(layer.k(x).view(b, s, N_KV, self.head_dim), cos, sin)
            v = layer.v(x).view(b, s, N_KV, self.head_dim)
            if self.layout == "bnsd":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                a = torch.ops.auto_deploy.torch_attention(q, k, v, is_causal=True, layout="bnsd").transpose(1, 2)
            else:
                a = torch.ops.auto_deploy.torch_attention(q, k, v, is_causal=True, layout="bsnd")
            h = h + layer.o(a.reshape(b, s, -1))
            h = h + layer.down(torch.relu(layer.up(_rms(h, layer.n2))))
        logits = self.lm_head(_rms(h, self.norm))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return (logits,)


def _export(model):
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=1, max=64)
    args = (torch.zeros(2, 4, dtype=torch.long), torch.arange(4).expand(2, 4))
    gm = _flatten_io(torch.export.export(model, args, dynamic_shapes=({0: batch, 1: seq},) * 2).module())
    return _run("cleanup_input_constraints", gm, PipelineContext(), stage="post_export")


def _run(key, gm, ctx, stage="cache_init", **fields):
    cls = TransformRegistry.get(key)
    return cls(cls.get_config_class()(stage=stage, **fields))(gm, ctx)


def _count(gm, target):
    return len(gm.graph.find_nodes(op="call_function", target=target))


def _ctx():
    return PipelineContext(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ)


def _cached(model, num_pages=24, **fields):
    gm, ctx = _export(model), _ctx()
    gm = _run("insert_cached_attention", gm, ctx, page_size=PAGE, **fields)
    gm = _run("initialize_cache", gm, ctx, num_pages=num_pages)
    return gm, SequenceInfo.from_spec(gm.meta["kv_cache"])


def _oracle_last(model, tokens):
    """Uncached logits of the last token of ``tokens``."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0][0, -1]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyDecoder().eval()


def test_insert_rewrites_graph_and_calling_convention(model):
    gm, ctx = _export(model), _ctx()
    assert _count(gm, torch.ops.auto_deploy.torch_attention.default) == LAYERS
    gm = _run("insert_cached_attention", gm, ctx, page_size=PAGE)
    info = transform_history(gm)["insert_cached_attention"].info
    assert info.num_matches == LAYERS and not info.skipped
    assert _count(gm, torch.ops.auto_deploy.torch_attention.default) == 0
    assert _count(gm, torch.ops.auto_deploy.torch_cached_attention.default) == LAYERS
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
    for step in range(6):
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
    model = TinyDecoder(layout="bnsd", softcap=5.0).eval()
    gm, info = _cached(model)
    (select,) = gm.graph.find_nodes(op="call_function", target=aten.index_select.default)
    assert [u.target for u in select.users] == [aten.linear.default]  # through the soft-cap's div/tanh/mul
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    logits = gm(**info.build([(s, 0, [2 * i, 2 * i + 1]) for i, s in enumerate(seqs)]).as_kwargs())[0]
    for step in range(2):
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[0, i], _oracle_last(model, s), **TOL)
            s.append(int(logits[0, i].argmax()))
        logits = gm(**info.build([([s[-1]], len(s) - 1, [2 * i, 2 * i + 1]) for i, s in enumerate(seqs)]).as_kwargs())[0]


def test_gather_before_an_int8_lm_head(model):
    """With quantize_weights (post_load_fusion, before this stage) the LM head is an int8 linear: the
    logits are still gathered before it, so a prompt computes the head for its last token only."""
    gm, ctx = _export(model), _ctx()
    gm = _run("quantize_weights", gm, ctx, stage="post_load_fusion")
    tokens = [4, 8, 15, 16, 23, 42]
    with torch.no_grad():
        want = gm(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0][0, -1]
    gm = _run("insert_cached_attention", gm, ctx, page_size=PAGE)
    gm = _run("initialize_cache", gm, ctx, num_pages=8)
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

    gm = _run("insert_cached_attention", _export(NoAttn()), _ctx())
    assert transform_history(gm)["insert_cached_attention"].info.skipped and "kv_cache" not in gm.meta
    gm = _run("initialize_cache", gm, _ctx())
    assert transform_history(gm)["initialize_cache"].info.skipped
    with pytest.raises(AutoDeployError, match="unknown attention backend"):
        torch.manual_seed(0)
        _run("insert_cached_attention", _export(TinyDecoder()), _ctx(), backend="nope")


def _cache_bytes(gm):
    return sum(t.numel() * t.element_size() for t in kvc.cache_tensors(gm, gm.meta["kv_cache"]))


def test_initialize_default_and_resize_within_budget(model, monkeypatch):
    gm, ctx = _export(model), _ctx()
    gm = _run("insert_cached_attention", gm, ctx, page_size=PAGE)
    gm = _run("initialize_cache", gm, ctx)
    spec = gm.meta["kv_cache"]
    assert spec.num_pages == MAX_BATCH * MAX_SEQ // PAGE == spec.max_useful_pages
    assert _cache_bytes(gm) == spec.nbytes() and all(t.device.type == "cpu" for t in kvc.cache_tensors(gm, spec))

    per_page = spec.bytes_per_page  # 4 tokens x 2 layers x (k+v) x 2 heads x 8 dims x 4 bytes = 1 KiB
    total = 10 * per_page + 500  # free memory + the current caches (which a resize releases first)
    monkeypatch.setattr(kvc, "available_memory_bytes", lambda device: total - _cache_bytes(gm))
    gm = _run("resize_kv_cache", gm, ctx, free_memory_fraction=0.5)  # budget 5.25 pages -> 5
    assert spec.num_pages == 5 and _cache_bytes(gm) <= 0.5 * total
    gm = _run("resize_kv_cache", gm, ctx, free_memory_fraction=1.0, max_tokens=13)  # 13 tokens -> 3 pages
    assert spec.num_pages == 3 and spec.max_tokens <= 13 and _cache_bytes(gm) == 3 * per_page
    gm = _run("resize_kv_cache", gm, ctx, free_memory_fraction=None, max_tokens=10_000)  # capped: max_useful_pages
    assert spec.num_pages == spec.max_useful_pages
    with pytest.raises(AutoDeployError, match="holds no KV-cache page"):
        _run("resize_kv_cache", gm, ctx, free_memory_fraction=None, max_tokens=PAGE - 1)
    assert spec.num_pages == spec.max_useful_pages  # a failed resize leaves the caches as they were
    monkeypatch.setattr(kvc, "available_memory_bytes", lambda device: 0)
    with pytest.raises(AutoDeployError, match="over its budget"):  # initialize never goes above free memory
        _run("initialize_cache", gm, ctx, num_pages=spec.max_useful_pages + 1)

    # the resized cache still computes the same logits
    gm = _run("resize_kv_cache", gm, ctx, free_memory_fraction=None, max_tokens=3 * PAGE)
    info = SequenceInfo.from_spec(spec)
    tokens = [5, 4, 3, 2, 1, 0, 9, 8, 7, 6]
    out = gm(**info.build([(tokens, 0, [2, 0, 1])]).as_kwargs())[0]
    torch.testing.assert_close(out[0, 0], _oracle_last(model, tokens), **TOL)


def test_allocate_refuses_over_budget(model):
    gm, ctx = _export(model), _ctx()
    gm = _run("insert_cached_attention", gm, ctx, page_size=PAGE)
    spec = gm.meta["kv_cache"]
    with pytest.raises(AutoDeployError, match="over its budget"):
        kvc.allocate_kv_caches(gm, spec, 4, "cpu", budget_bytes=4 * spec.bytes_per_page - 1)
    assert spec.num_pages == 0 and all(t.is_meta for t in kvc.cache_tensors(gm, spec))


def test_yaml_entries_through_the_optimizer(model):
    from autodeploy.config.loader import AutoDeployConfig
    from autodeploy.transform import InferenceOptimizer

    config = AutoDeployConfig(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, transforms={
        "insert_cached_attention": {"stage": "cache_init", "backend": "torch", "page_size": 8, "gather_logits": True},
        "initialize_cache": {"stage": "cache_init", "num_pages": None},
        "resize_kv_cache": {"stage": "cache_init", "free_memory_fraction": 0.9, "max_tokens": 40},
    })
    gm = InferenceOptimizer(config)(_export(model))
    spec = gm.meta["kv_cache"]
    assert (spec.page_size, spec.num_pages) == (8, 5)
    info = SequenceInfo.from_spec(spec)
    tokens = list(range(1, 12))
    out = gm(**info.build([(tokens, 0, [4, 1])]).as_kwargs())[0]
    torch.testing.assert_close(out[0, 0], _oracle_last(model, tokens), **TOL)

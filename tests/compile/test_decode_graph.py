"""The decode graph (compile/torch_compile.py, ``decode_graph``): where the native kernels run, each layer's RoPE,
cache write and attention become one call (``fuse_rope_into_attention``), with the logits and cache contents of
the unfused graph; ``AUTODEPLOY_FUSED_ATTENTION=0`` keeps them apart."""

import pytest
import torch

from autodeploy import LLM
from autodeploy.compile.torch_compile import FUSED_ATTENTION_ENV, decode_graph
from autodeploy.custom_ops import native
from autodeploy.custom_ops.cached_attention import paged_decode_attention_native, paged_decode_attention_rope_native
from autodeploy.runtime.engine import find_cached_graph
from autodeploy.runtime.sequence_info import SequenceInfo, SequenceRequest

pytestmark = pytest.mark.skipif(not native.decode_attention_available(), reason="the native kernels do not run here")

_ROPES = (torch.ops.auto_deploy.rope.default, torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_each_layers_rope_cache_write_and_attention_become_one_call(tiny_checkpoint, monkeypatch):
    llm = LLM(tiny_checkpoint("llama"), max_batch_size=2, max_seq_len=64)
    gm, spec = find_cached_graph(llm.module)
    layers = len(spec.layers)
    fused = decode_graph(gm)
    assert _targets(fused).count(paged_decode_attention_rope_native) == layers
    assert not any(t in _ROPES for t in _targets(fused)) and paged_decode_attention_native not in _targets(fused)
    # cos and sin reach the fused calls as Inductor computes them, without materialize's two calls (measured faster)
    assert torch.ops.auto_deploy.materialize.default not in _targets(fused)
    monkeypatch.setenv(FUSED_ATTENTION_ENV, "0")
    plain = decode_graph(gm)
    assert _targets(plain).count(paged_decode_attention_native) == layers
    assert paged_decode_attention_rope_native not in _targets(plain)

    # two sequences decoding one token each, over history already in the cache (shared by the graphs)
    for name, cache in gm.named_buffers():
        if name.startswith("kv_cache_"):
            cache.copy_(torch.randn_like(cache))
    info = SequenceInfo(spec.max_batch_size, spec.max_seq_len, spec.page_size, spec.num_pages)
    seqs = [SequenceRequest([7], 5, [1]), SequenceRequest([11], 40, [0])]
    args = info.build(seqs, gather="last").as_args()
    caches = {name: cache.clone() for name, cache in gm.named_buffers() if name.startswith("kv_cache_")}
    with torch.no_grad():
        want = plain(*args)[0]
        written = {name: cache.clone() for name, cache in gm.named_buffers() if name.startswith("kv_cache_")}
        for name, cache in gm.named_buffers():
            if name in caches:
                cache.copy_(caches[name])  # as before the step
        got = fused(*args)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, cache in gm.named_buffers():
        if name in written:
            torch.testing.assert_close(cache, written[name], atol=1e-6, rtol=1e-6)
            assert not torch.equal(cache, caches[name])  # the step wrote its token

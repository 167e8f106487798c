"""compile stage: compile_model's backends (one torch.compile run, checked against HF)."""

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.compile.torch_compile import _warmup_shapes
from autodeploy.errors import ConfigError
from autodeploy.runtime.sequence_info import SequenceRequest
from tiny_models import hf_reference

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def test_warmup_shapes_capped_by_max_batch_size():
    assert _warmup_shapes([1, 2, 4, 8], 4, prefill=False) == [(1, 1), (2, 1), (4, 1)]
    assert _warmup_shapes([1, 16], 2, prefill=True) == [(1, 1), (2, 1), (1, 2), (2, 2)]


def test_bad_backend_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError, match="backend"):
        LLM(tiny_checkpoint("llama"), overrides={"transforms.compile_model.backend": "tensorrt"})


@pytest.mark.slow  # compiles with Inductor
@pytest.mark.parametrize("freeze_weights", [False, True])
def test_torch_compile_logits_and_greedy_tokens_match_hf(tiny_checkpoint, freeze_weights):
    """torch-compile serves decode batches with one Inductor graph (no graph breaks, cached attention as
    plain torch) and other batches with the cached graph. Against HF in fp32: the logits of a mixed batch
    and of a decode batch within 1e-4, then greedy tokens identical to HF generate."""
    from torch._dynamo.utils import counters

    from autodeploy.custom_ops import native

    path = tiny_checkpoint("llama")
    counters.clear()
    compiled = LLM(path, max_batch_size=2, max_seq_len=64,
                   overrides={"transforms.compile_model.backend": "torch-compile",
                              "transforms.compile_model.capture_batch_sizes": [1, 2],
                              "transforms.compile_model.freeze_weights": freeze_weights,
                              # both ways of serving prefill: compiled (default) and eager
                              "transforms.compile_model.compile_prefill": not freeze_weights})
    assert type(compiled.module).__name__ == "DecodeDispatch"
    decode = compiled.module.decode._orig_mod
    left = {str(n.target) for n in decode.graph.nodes if n.op == "call_function" and "auto_deploy" in str(n.target)}
    # only the native linear where it runs (over panels where the build reads them: pack_f32_weights) and, where
    # RoPE stays in the graph (no native attention to fuse it into), the barrier that computes its tables once
    linear = "f32_packed_linear" if native.f32_pack_width() else "f32_linear"
    fused = native.decode_attention_available()
    assert left - {f"auto_deploy.{linear}.default"} == (set() if fused else {"auto_deploy.materialize.default"})
    materialize = decode.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.materialize.default)
    assert len(materialize) == (0 if fused else 2)
    general = compiled.module.general
    assert (type(general).__name__ == "OptimizedModule") == (not freeze_weights)
    general = getattr(general, "_orig_mod", general)
    assert general.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.torch_cached_attention.default)
    assert compiled.module.decode.get_submodule("_orig_mod") is decode
    # native_linear's operator: the decode graph calls it; a compiled prompt graph reads it as a plain linear,
    # an eager one (compile_prefill off) calls it (torch's linear beyond 16 rows); the packed operator has no
    # plain form (its weight is in panels): every graph calls it
    has_native = native.f32_linear_available()
    assert (f"auto_deploy.{linear}.default" in left) == has_native
    if has_native:
        in_prompt = general.graph.find_nodes(op="call_function", target=getattr(torch.ops.auto_deploy, linear).default)
        assert bool(in_prompt) == (freeze_weights or linear == "f32_packed_linear")

    engine, reference = compiled.engine, hf_reference(path)
    pages = [[0], [1]]
    batch = engine.info.build([SequenceRequest(p, 0, pg) for p, pg in zip(PROMPTS, pages)], gather="all")
    nxt = [3, 11]
    decode_batch = engine.info.build([SequenceRequest([t], len(p), pg) for t, p, pg in zip(nxt, PROMPTS, pages)])
    with torch.no_grad():
        logits = compiled.module(*batch.as_args())[0][0]
        expected = torch.cat([reference(torch.tensor([p])).logits[0] for p in PROMPTS])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        with torch.profiler.profile() as prof:
            step = compiled.module(*decode_batch.as_args())[0][0]
        torch.testing.assert_close(compiled.module(**decode_batch.as_kwargs())[0][0], step, atol=0, rtol=0)
        expected = torch.stack([reference(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(PROMPTS, nxt)])
    torch.testing.assert_close(step, expected, atol=1e-4, rtol=0)
    if has_native:
        assert f"auto_deploy::{linear}" in {event.name for event in prof.events()}

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, compiled.generate(PROMPTS, params)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                    do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == hf[0, len(prompt):].tolist()
    assert not counters["graph_break"], dict(counters["graph_break"])
    # no recompiles while serving: decode at batch 1 and at batch 2 (one graph each), and one prompt graph
    # for one and for two sequences
    assert counters["stats"]["unique_graphs"] == (2 if freeze_weights else 3), dict(counters["stats"])
    # freezing prepacks the linears' weights for oneDNN (multi-sequence graph only), where the native
    # kernel does not take them
    packed = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > 0
    assert packed == (freeze_weights and not has_native)


@pytest.mark.slow  # compiles with Inductor
def test_torch_compile_with_int8_weights_matches_eager_int8(tiny_checkpoint):
    """int8 weights under torch-compile: the decode graph calls the native kernel where it applies (one
    Inductor graph, no breaks) and the prompt graph the split-activation GEMM in plain torch. Their logits
    agree with the eager int8 pipeline's to the paths' rounding differences (16-bit vs bf16 activations
    for the one product whose K is not a multiple of 64), far below the int8 weight error."""
    from torch._dynamo.utils import counters

    from autodeploy.custom_ops import native

    path = tiny_checkpoint("llama")
    int8 = {"transforms.quantize_weights.enabled": True, "transforms.fuse_gemms.enabled": True}
    eager = LLM(path, max_batch_size=2, max_seq_len=64, overrides=int8)
    counters.clear()
    compiled = LLM(path, max_batch_size=2, max_seq_len=64,
                   overrides={**int8, "transforms.compile_model.backend": "torch-compile",
                              "transforms.compile_model.capture_batch_sizes": [1, 2]})
    decode = compiled.module.decode._orig_mod
    calls = {str(n.target) for n in decode.graph.nodes if n.op == "call_function"}
    assert not any("torch_int8_linear" in c for c in calls)  # every int8 linear has its compile form
    pages = [[0], [1]]
    engine = compiled.engine
    batch = engine.info.build([SequenceRequest(p, 0, pg) for p, pg in zip(PROMPTS, pages)], gather="all")
    nxt = [3, 11]
    decode_batches = [engine.info.build([SequenceRequest([t], len(p), pg)])
                      for t, p, pg in zip(nxt, PROMPTS, pages)]  # batch 1: the native kernel's graph
    with torch.no_grad():
        want = eager.module(*batch.as_args())[0][0]
        got = compiled.module(*batch.as_args())[0][0]
        steps = [(eager.module(*b.as_args())[0][0], compiled.module(*b.as_args())[0][0]) for b in decode_batches]
        plain = torch.cat([hf_reference(path)(torch.tensor([p])).logits[0] for p in PROMPTS])
    std = float(plain.std())
    assert float((want - plain).abs().mean()) > 1e-3 * std  # both really run int8 weights
    # without the native kernel, eager decode products round activations to bfloat16 (torch's int8 kernel,
    # INT8_GEMV_VS_TORCH_RTOL per product) where the compiled form keeps float32: a looser, stated bound
    tolerance = (0.01 if native.int8_gemv_available() else 0.02) * std
    torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
    for want_step, got_step in steps:
        torch.testing.assert_close(got_step, want_step, atol=tolerance, rtol=0)
    assert not counters["graph_break"], dict(counters["graph_break"])
    if native.int8_gemv_available():  # the compiled batch-1 decode step calls the native kernel's operator
        with torch.no_grad(), torch.profiler.profile() as prof:
            compiled.module(*decode_batches[0].as_args())
        assert "auto_deploy::int8_gemv" in {event.name for event in prof.events()}


@pytest.mark.slow  # compiles with Inductor, twice
def test_two_compiled_models_of_one_architecture_in_one_process(tiny_checkpoint):
    """The decode graph is compiled without guards on its module's attributes (the runtime never changes
    them), so each model must keep its own compiled code: two llamas of different sizes, alive together,
    each give its uncompiled tokens, the first again after the second was compiled."""
    small, large = tiny_checkpoint("llama"), tiny_checkpoint("llama", hidden_size=128, intermediate_size=256)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def tokens(llm):
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]

    expected = {path: tokens(LLM(path, max_batch_size=2, max_seq_len=32)) for path in (small, large)}
    compiled = {path: LLM(path, max_batch_size=2, max_seq_len=32,
                          overrides={"transforms.compile_model.backend": "torch-compile",
                                     "transforms.compile_model.capture_batch_sizes": [1, 2]})
                for path in (small, large)}
    assert tokens(compiled[large]) == expected[large]
    assert tokens(compiled[small]) == expected[small]
    assert tokens(compiled[large]) == expected[large]


@pytest.mark.slow  # compiles with Inductor
def test_torch_compile_with_int4_weights_decodes_as_eager(tiny_checkpoint):
    """4-bit weights under torch-compile (packed in tiles where the native x86 kernels read them): the compiled
    decode step calls the packed product's operator with no graph break, and greedy tokens and log-probabilities
    equal the eager pipeline's."""
    from torch._dynamo.utils import counters

    from autodeploy.custom_ops import native

    path = tiny_checkpoint("llama")
    int4 = {"transforms.quantize_weights.enabled": True, "transforms.quantize_weights.dtype": "int4"}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    eager = LLM(path, max_batch_size=2, max_seq_len=64, overrides=int4)
    want = [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs] for o in eager.generate(PROMPTS[:2], params)]
    counters.clear()
    compiled = LLM(path, max_batch_size=2, max_seq_len=64,
                   overrides={**int4, "transforms.compile_model.backend": "torch-compile",
                              "transforms.compile_model.capture_batch_sizes": [1, 2]})
    got = [[(t.token_id, t.logprob) for t in o.outputs[0].logprobs] for o in compiled.generate(PROMPTS[:2], params)]
    for w, g in zip(want, got, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < 1e-4
    assert not counters["graph_break"], dict(counters["graph_break"])
    calls = {str(n.target) for n in compiled.module.decode._orig_mod.graph.nodes if n.op == "call_function"}
    packed = native.int4_pack_rows() > 0
    assert any(("int4_packed_linear" if packed else "int4_linear") in c for c in calls), calls

"""The generation runtime on a tiny hand-written decoder (its exported graph already holds torch_attention):
Engine / LLM over the cache_init graph against a plain uncached greedy loop on the same module."""

import pytest
import torch

import autodeploy
from autodeploy import LLM, SamplingParams
from autodeploy.llm import Engine, llm_config
from autodeploy.transform import PipelineContext
from helpers import ToyLM, export_toy_lm, run_transform

VOCAB, PAGE = 40, 4
MAX_BATCH, MAX_SEQ = 4, 32


def cached_graph(model, num_pages=None, max_tokens=None, page_size=PAGE):
    ctx = PipelineContext(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ)
    gm = run_transform("insert_cached_attention", export_toy_lm(model), "cache_init", ctx, page_size=page_size)
    gm = run_transform("gather_logits_before_lm_head", gm, "cache_init", ctx)
    gm = run_transform("initialize_cache", gm, "cache_init", ctx, num_pages=num_pages)
    if max_tokens is not None:
        gm = run_transform("resize_kv_cache", gm, "cache_init", ctx, free_memory_fraction=None, max_tokens=max_tokens)
    return gm


def greedy_uncached(model, prompt, max_tokens, eos=None):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0]
            seq.append(int(logits[0, -1].argmax()))
            if seq[-1] == eos:
                break
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ToyLM(vocab=VOCAB, logit_scale=3).eval()  # sharper logits: fewer near-ties in greedy


@pytest.fixture(scope="module")
def gm(model):
    return cached_graph(model)


PROMPTS = [[3, 9, 4, 1, 7], [11, 2], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20], [30, 31, 32, 33]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def expected(model):
    return [greedy_uncached(model, p, 8) for p in PROMPTS]


def test_greedy_matches_uncached_loop(gm, expected):
    outs = Engine(gm).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == PROMPTS and all(o.prompt is None for o in outs)
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].text is None for o in outs)


def test_outputs_carry_the_log_probabilities_asked_for(model, gm, expected):
    """``logprobs=N``: each output token's log-probability (the uncached model's log-softmax) and its top N."""
    outs = Engine(gm).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))
    for prompt, out, want in zip(PROMPTS, outs, expected):
        seq = prompt + want
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq]), torch.arange(len(seq))[None])[0][0].float(), -1)
        got = out.outputs[0].logprobs
        assert [t.token_id for t in got] == want
        for i, entry in enumerate(got):
            row = logp[len(prompt) - 1 + i]
            assert abs(entry.logprob - float(row[want[i]])) < 1e-4
            assert [tok for tok, _ in entry.top] == row.topk(2).indices.tolist()
    assert Engine(gm).generate(PROMPTS[:1], GREEDY)[0].outputs[0].logprobs is None


@pytest.mark.parametrize("max_tokens", [20, 28])  # 5 / 7 pages: one or two sequences at once
def test_greedy_with_a_small_kv_budget(model, expected, max_tokens):
    gm = cached_graph(model, max_tokens=max_tokens)
    assert gm.meta["kv_cache"].max_tokens == max_tokens
    engine = Engine(gm)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.scheduler.max_pages_in_use <= max_tokens // PAGE
    assert engine.scheduler.pool.num_free == max_tokens // PAGE


def test_chunked_prefill_and_one_seq_at_a_time(model, gm, expected):
    engine = Engine(gm, max_num_tokens=3)  # prompts are prefilled 3 tokens at a time
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_eos_stops_and_ignore_eos(model, gm):
    prompt = PROMPTS[0]
    full = greedy_uncached(model, prompt, 8)
    eos = full[3]
    llm = LLM(model=gm, eos_token_ids=eos)
    out = llm.generate(prompt, GREEDY)[0].outputs[0]
    assert out.token_ids == full[: full.index(eos) + 1] and out.finish_reason == "eos"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == full and out.finish_reason == "length"


def test_seeded_sampling_reproducible(gm):
    llm = LLM(model=gm)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=5, max_tokens=10)
    a = llm.generate(PROMPTS, params)
    b = llm.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in a[:2]] == [o.outputs[0].token_ids for o in b]
    per_prompt = [SamplingParams(temperature=1.0, seed=s, max_tokens=10) for s in range(len(PROMPTS))]
    c = llm.generate(PROMPTS, per_prompt)
    assert [o.outputs[0].token_ids for o in c] != [o.outputs[0].token_ids for o in a]  # other seeds, other tokens


def test_streaming_yields_every_token(gm, expected):
    llm = LLM(model=gm)
    got = {i: [] for i in range(len(PROMPTS))}
    order = []
    for index, token, delta in llm.generate_stream(PROMPTS, GREEDY):
        got[index].append(token)
        order.append(index)
        assert delta == ""  # no tokenizer
    assert [got[i] for i in range(len(PROMPTS))] == expected
    assert order[:4] == [0, 1, 2, 3]  # interleaved: the first batch's first tokens come together
    # an abandoned stream frees its pages
    stream = llm.generate_stream(PROMPTS, GREEDY)
    next(stream)
    stream.close()
    sched = llm.engine.scheduler
    assert sched.pool.num_free == sched.info.num_pages and not sched.has_unfinished()


@pytest.mark.parametrize("prompt, params, message", [
    (list(range(1, 34)), GREEDY, "max_seq_len=32"),
    ([1] * 30, SamplingParams(max_tokens=3), "max_tokens=3 = 33, more than max_seq_len=32"),
    ([], GREEDY, "empty"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(top_p=1.5), "top_p"),
    ([1, 2], SamplingParams(top_k=-1), "top_k"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, VOCAB], GREEDY, f"vocab_size={VOCAB}"),
    ("some text", GREEDY, "tokenizer"),
])
def test_bad_input_raises_value_error_and_engine_keeps_serving(gm, expected, prompt, params, message):
    llm = LLM(model=gm)
    with pytest.raises(ValueError, match="prompt 1: .*" + message.replace("(", r"\(")):
        llm.generate([PROMPTS[0], prompt], [GREEDY, params])
    assert not llm.engine.scheduler.has_unfinished()  # nothing was queued
    outs = llm.engine.generate([PROMPTS[0], prompt, PROMPTS[1]], [GREEDY, params, GREEDY])
    assert outs[1].outputs[0].finish_reason == "rejected" and message in outs[1].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected[:2]


def test_request_over_the_kv_budget_raises(model):
    llm = LLM(model=cached_graph(model, max_tokens=8))
    with pytest.raises(ValueError, match="kv_cache max_tokens=8"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6))


def test_no_kv_cache_is_a_clear_error(model):
    with pytest.raises(autodeploy.AutoDeployError, match="torch_attention"):
        LLM(model=model)


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "<eos>"] + list(" abcdefghijklmnopqrstuvwxyz.,!?")
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def test_text_prompts_text_output_and_stream_deltas(model, gm):
    tok = char_tokenizer()
    llm = LLM(model=gm, tokenizer=tok)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["hello", "a b"], params)
    for out, text in zip(outs, ["hello", "a b"]):
        ids = tok(text)["input_ids"]
        assert out.prompt == text and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == greedy_uncached(model, ids, 6)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    deltas = {0: "", 1: ""}
    for i, _, delta in llm.generate_stream(["hello", "a b"], params):
        deltas[i] += delta
    assert [deltas[0], deltas[1]] == [o.outputs[0].text for o in outs]


def test_llm_config_maps_arguments(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("max_seq_len: 100\n")
    cfg = llm_config("/nonexistent", max_batch_size=3, max_seq_len=64, kv_cache_config={"max_tokens": 256},
                     yaml_extra=extra, **{"model_kwargs": {"num_hidden_layers": 1}})
    assert (cfg.max_batch_size, cfg.max_seq_len, cfg.model) == (3, 64, "/nonexistent")
    assert cfg.model_kwargs == {"num_hidden_layers": 1}
    assert cfg.transforms["resize_kv_cache"]["max_tokens"] == 256
    for key in ("insert_cached_attention", "initialize_cache", "resize_kv_cache"):
        assert cfg.transforms[key]["stage"] == "cache_init"
    keys = list(cfg.transforms)
    assert keys.index("insert_cached_attention") < keys.index("initialize_cache") < keys.index("resize_kv_cache")
    cfg = llm_config("/x", kv_cache_config={"free_memory_fraction": 0.25, "page_size": 16})
    assert cfg.transforms["resize_kv_cache"]["free_memory_fraction"] == 0.25
    assert cfg.transforms["insert_cached_attention"]["page_size"] == 16
    with pytest.raises(ValueError, match="unknown kv_cache_config"):
        llm_config("/x", kv_cache_config={"max_tokenz": 3})


def test_pipeline_settings_with_a_module_are_an_error(gm):
    with pytest.raises(ValueError, match="max_seq_len"):
        LLM(model=gm, max_seq_len=16)

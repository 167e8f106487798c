"""The server through the official openai client: completions (every prompt form), chat, streaming,
logprobs, echo, stop strings, the vLLM extras; greedy output identical to LLM.generate."""

import httpx
import pytest

from conftest import MAX_TOKENS, MODEL, PROMPTS

GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})


def test_models_and_health(served):
    assert [m.id for m in served.client().models.list().data] == [MODEL]
    assert httpx.get(served.url + "/health").status_code == 200


def test_completions_every_prompt_form_match_llm_generate(served, reference):
    client, tok = served.client(), served.state.engine.tokenizer
    one = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
    assert one.choices[0].text == reference[PROMPTS[0]].text and one.choices[0].finish_reason == "length"
    assert one.usage.completion_tokens == MAX_TOKENS and one.usage.prompt_tokens == len(tok(PROMPTS[0])["input_ids"])
    many = client.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    assert [c.index for c in many.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in many.choices] == [reference[p].text for p in PROMPTS]
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    by_ids = client.completions.create(model=MODEL, prompt=ids[1], **GREEDY)
    assert by_ids.choices[0].text == reference[PROMPTS[1]].text
    by_id_lists = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert [c.text for c in by_id_lists.choices] == [reference[p].text for p in PROMPTS]


def test_streaming_deltas_concatenate_to_the_text(served, reference):
    client = served.client()
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference[PROMPTS[3]].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    # the raw event stream ends with [DONE]
    with httpx.stream("POST", served.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                                   "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)


def test_chat_uses_the_template_and_streams(served):
    client = served.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    rendered = "system: be brief\nuser: hi there\nassistant:"  # the demo template
    ids = served.state.engine.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].message.role == "assistant"
    same = served.client().completions.create(model=MODEL, prompt=ids, **GREEDY).choices[0].text
    assert out.choices[0].message.content == same
    streamed = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    logprobs = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2,
                                              **GREEDY).choices[0].logprobs.content
    # logprob tokens are each token's own text, special tokens included (the message skips them)
    assert "".join(e.token for e in logprobs if e.token != "<eos>") == out.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in logprobs)


def test_chat_without_a_template_is_400_naming_it(served):
    tokenizer = served.state.engine.tokenizer  # the demo tokenizer ships a template: take it away for this test
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        r = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    finally:
        tokenizer.chat_template = template
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    assert "--chat-template" in r.json()["error"]["message"]


def test_logprobs_and_echo(served, reference):
    client, tok = served.client(), served.state.engine.tokenizer
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, **GREEDY).choices[0]
    lp = out.logprobs
    assert "".join(lp.tokens) == out.text and len(lp.token_logprobs) == MAX_TOKENS
    for chosen, tops in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen token is the top one
        assert len(tops) <= 3 and chosen == pytest.approx(max(tops.values())) and chosen < 0
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=1, echo=True, **GREEDY).choices[0]
    n_prompt = len(tok(PROMPTS[0])["input_ids"])
    assert echo.text == PROMPTS[0] + out.text
    assert echo.logprobs.tokens == list(PROMPTS[0]) + lp.tokens  # the character tokenizer
    assert echo.logprobs.token_logprobs[0] is None and echo.logprobs.top_logprobs[0] is None
    assert all(v < 0 for v in echo.logprobs.token_logprobs[1:])
    assert echo.logprobs.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert echo.logprobs.text_offset[:3] == [0, 1, 2]
    # scoring only (evaluation harnesses): max_tokens=0 with echo returns the prompt's logprobs
    score = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=0, echo=True, max_tokens=0)
    assert score.choices[0].text == PROMPTS[0] and score.usage.completion_tokens == 0
    assert score.choices[0].logprobs.token_logprobs == pytest.approx(echo.logprobs.token_logprobs[:n_prompt])


def test_stop_strings_end_before_them(served, reference):
    client = served.client()
    full = reference[PROMPTS[3]].text
    stop = full[4:6]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPTS[3], stop=[stop, "never-seen"], stream=stream,
                                        **GREEDY)
        if stream:
            chunks = [c.choices[0] for c in out if c.choices]
            text, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
        else:
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert text == expected and finish == "stop"


def test_vllm_extras_min_tokens_ignore_eos_top_k(served, reference):
    client = served.client()
    # top_k=1 samples greedily whatever the temperature
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=1.0, max_tokens=MAX_TOKENS,
                                    extra_body={"top_k": 1, "ignore_eos": True})
    assert out.choices[0].text == reference[PROMPTS[1]].text
    eos = served.state.engine.scheduler.eos_token_ids
    # min_tokens: the demo's EOS is never sampled before 10 tokens (high temperature: EOS would come early)
    for seed in range(3):
        out = client.completions.create(model=MODEL, prompt="x", temperature=5.0, max_tokens=10, seed=seed,
                                        extra_body={"min_tokens": 10})
        assert out.usage.completion_tokens == 10 and eos


def test_seeded_sampling_is_reproducible(served):
    client = served.client()
    a, b = (client.completions.create(model=MODEL, prompt="abc", temperature=1.0, top_p=0.9, seed=7, max_tokens=10)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text

"""Engine features the server exposes, on the toy LM's cached graph against an uncached run of the same
module: logprobs and prompt logprobs, min_tokens, stop strings (with the demo's character tokenizer),
abort, and prefix caching (the same tokens and logprobs with and without it, fewer tokens prefilled)."""

import pytest
import torch

from autodeploy.models.demo import char_tokenizer
from autodeploy.runtime.engine import Engine, _Detokenizer
from autodeploy.runtime.prefix_cache import PrefixCachingPool
from autodeploy.runtime.sampler import SamplingParams
from autodeploy.transform import PipelineContext
from helpers import ToyLM, export_toy_lm, run_transform

VOCAB, PAGE = 40, 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ToyLM(vocab=VOCAB, logit_scale=3).eval()


@pytest.fixture(scope="module")
def gm(model):
    ctx = PipelineContext(max_batch_size=4, max_seq_len=48)
    gm = run_transform("insert_cached_attention", export_toy_lm(model), "cache_init", ctx, page_size=PAGE)
    gm = run_transform("gather_logits_before_lm_head", gm, "cache_init", ctx)
    return run_transform("initialize_cache", gm, "cache_init", ctx, num_pages=40)


def uncached_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0][0]
    return torch.log_softmax(logits.float(), -1)


PREFIX = [3, 9, 4, 1, 7, 2, 8, 5, 6, 10, 11, 12, 13]  # three full pages and one token
SUFFIXES = [[20, 21], [22], [23, 24, 25, 26, 27]]


def test_logprobs_and_prompt_logprobs_match_the_uncached_model(model, gm):
    prompt = PREFIX + SUFFIXES[0]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    engine = Engine(gm, max_num_tokens=6)  # chunked prefill: prompt logprobs across chunks
    req = engine.add_request(prompt, params)
    while engine.scheduler.has_unfinished():
        engine.step()
    ref = uncached_logprobs(model, prompt + req.output_token_ids)
    assert req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == len(prompt)
    for pos, entry in enumerate(req.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        assert [t for t, _ in entry.top] == ref[pos - 1].topk(2).indices.tolist()
    assert len(req.logprobs) == 5
    for i, entry in enumerate(req.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == req.output_token_ids[i] == int(row.argmax())  # greedy: the top token
        assert entry.logprob == pytest.approx(float(row.max()), abs=1e-4) == entry.top[0][1]
        assert len(entry.top) == 3


def test_min_tokens_holds_eos_back(model, gm):
    prompt = PREFIX
    free = Engine(gm).generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    engine = Engine(gm, eos_token_ids=free[0])  # EOS is what greedy picks first
    assert engine.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids == free[:1]
    out = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=6, min_tokens=3))[0].outputs[0]
    assert len(out.token_ids) >= 3 and free[0] not in out.token_ids[:3]
    assert SamplingParams(max_tokens=2, min_tokens=3).problem().startswith("min_tokens=3 is more than")


def test_detokenizer_stops_before_stop_strings_and_holds_back_their_start():
    tok = char_tokenizer()
    ids = tok("hello world, bye")["input_ids"]
    detok = _Detokenizer(tok, stop=["wor", "xyz"])
    deltas, stopped = [], False
    for n in range(1, len(ids) + 1):
        delta, stopped = detok.update(ids[:n], final=False)
        deltas.append(delta)
        if stopped:
            break
    assert stopped and "".join(deltas) == detok.text == "hello "
    assert all(len("".join(deltas[:i + 1])) <= max(0, i - 1) for i in range(len(deltas) - 1))  # 2 chars held back


def test_abort_frees_pages(gm):
    engine = Engine(gm, enable_prefix_caching=False)
    req = engine.add_request(PREFIX, SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    assert engine.scheduler.num_pages_in_use > 0
    engine.abort(req)
    assert req.finish_reason == "aborted" and engine.scheduler.num_pages_in_use == 0
    assert not engine.scheduler.has_unfinished()


def test_prefix_caching_same_tokens_and_logprobs(gm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    results = {}
    for caching in (False, True):
        engine = Engine(gm, enable_prefix_caching=caching)
        results[caching] = []
        for suffix in SUFFIXES:  # one after the other: the later ones find the prefix's pages
            req = engine.add_request(PREFIX + suffix, params)
            while engine.scheduler.has_unfinished():
                engine.step()
            results[caching].append(req)
        if caching:
            assert [r.num_prefix_cached for r in results[caching]] == [0, 12, 12]
            assert engine.scheduler.pool.hit_tokens == 24
        assert engine.scheduler.num_pages_in_use == 0  # cached pages are evictable, counted free
    for off, on in zip(results[False], results[True]):
        assert on.output_token_ids == off.output_token_ids
        for a, b in zip(off.logprobs, on.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_prefix_caching_concurrent_requests_and_eviction(gm):
    params = SamplingParams(temperature=0, max_tokens=4)
    prompts = [PREFIX + s for s in SUFFIXES] * 2
    expected = [o.outputs[0].token_ids for o in Engine(gm, enable_prefix_caching=False).generate(prompts, params)]
    engine = Engine(gm)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == expected
    # many distinct prompts through the same pool: cached pages are evicted, results still right
    distinct = [[(7 * i + j) % VOCAB for j in range(20)] for i in range(12)]
    ref = [o.outputs[0].token_ids for o in Engine(gm, enable_prefix_caching=False).generate(distinct, params)]
    assert [o.outputs[0].token_ids for o in engine.generate(distinct, params)] == ref
    assert engine.scheduler.pool.num_free == engine.scheduler.info.num_pages


def test_pool_shares_by_prefix_and_evicts_least_recently_used():
    pool = PrefixCachingPool(num_pages=3, page_size=2)
    a = pool.allocate(2)
    pool.publish(a[0], [1, 2])
    pool.publish(a[1], [1, 2, 3, 4])
    assert pool.match([1, 2, 3, 4, 5]) == a and pool.match([1, 2, 3, 4]) == a[:1]  # the last token is computed
    assert pool.match([1, 9, 9]) == [] and pool.match([2, 2, 3]) == []
    pool.acquire(a[:1])  # a second request shares the first page
    pool.free(a)
    assert pool.num_free == 2 and pool.num_unreferenced(a) == 1  # a[1] evictable, a[0] still held
    pool.free(a[:1])
    assert pool.num_free == 3
    pool.allocate(1)  # the never-published page first: both cached pages survive
    assert pool.match([1, 2, 3, 4, 5]) == a
    pool.allocate(1)  # then the least recently used: the prefix's tail went first
    assert pool.match([1, 2, 3, 4, 5]) == a[:1]
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0]])


def test_forward_runs_without_grad_and_restores_the_callers_mode(gm):
    seen = []

    class Recording(torch.nn.Module):
        def __init__(self, inner, fail):
            super().__init__()
            self.inner, self.fail, self.meta = inner, fail, inner.meta

        def forward(self, *args):
            seen.append(torch.is_grad_enabled())
            if self.fail:
                raise RuntimeError("model failed")
            return self.inner(*args)

    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            engine = Engine(Recording(gm, fail=False))
            req = engine.add_request([3, 9, 4], SamplingParams(temperature=0, max_tokens=2))
            while engine.scheduler.has_unfinished():
                engine.step()
            assert len(req.output_token_ids) == 2 and torch.is_grad_enabled() == grad
            engine = Engine(Recording(gm, fail=True))
            engine.add_request([3, 9, 4], SamplingParams(temperature=0, max_tokens=2))
            with pytest.raises(RuntimeError, match="model failed"):
                engine.step()
            assert torch.is_grad_enabled() == grad
    assert seen and not any(seen)


@pytest.mark.parametrize("max_tokens", [8, 20], ids=["finishes-in-the-same-step", "runs-on"])
def test_a_stop_string_inside_a_multi_step_decode_step_ends_the_request_there(gm, max_tokens):
    """The tokens a step of several decode forwards ran past a stop string are dropped: the same tokens, text
    and finish reason as one forward a step (also where the request reached max_tokens later in that step)."""
    tok = char_tokenizer()
    prompt = PREFIX[:5]
    free = Engine(gm, tokenizer=tok, decode_steps=1).generate(
        prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].outputs[0]
    # a stop string that ends with the text of the output's 5th token: found within the second step's forwards
    end = len(tok.decode(free.token_ids[:5], skip_special_tokens=True))
    stop = free.text[max(0, end - 2):end]
    assert stop and stop not in free.text[: end - 1]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=[stop])
    results, forwards = [], []
    for decode_steps in (1, 8):
        engine = Engine(gm, tokenizer=tok, decode_steps=decode_steps)
        out = engine.generate(prompt, params)[0].outputs[0]
        results.append((out.token_ids, out.text, out.finish_reason))
        forwards.append(engine.scheduler.num_steps)
        assert engine.scheduler.pool.num_free == engine.scheduler.info.num_pages
    assert results[0] == results[1]
    assert forwards[0] == 5 and forwards[1] > 5  # the multi-step engine decoded past the stop string
    assert results[0][2] == "stop" and len(results[0][0]) == 5 and results[0][1] == free.text[: end - len(stop)]

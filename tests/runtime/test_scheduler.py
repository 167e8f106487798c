"""Continuous batching with a fake forward that keeps its own paged "cache" of token ids: the next token is
a function of the whole history read back from the pages, so wrong pages, clobbered pages or a wrong
input_pos change the output."""

import pytest
import torch

from autodeploy.runtime.sampler import SamplingParams
from autodeploy.runtime.scheduler import Scheduler
from autodeploy.runtime.sequence_info import SequenceInfo

VOCAB = 50


def next_token(history):
    return (sum((i + 1) * t for i, t in enumerate(history)) * 7 + len(history)) % VOCAB


def oracle(prompt, max_tokens, stop=()):
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        tok = next_token(seq)
        seq.append(tok)
        out.append(tok)
        if tok in stop:
            break
    return out


class FakeModel:
    """Checks every forward against the limits and returns one-hot logits of ``next_token(history)``."""

    def __init__(self, info: SequenceInfo):
        self.info = info
        self.cache = torch.full((info.num_pages, info.page_size), -1, dtype=torch.long)
        self.calls = []  # per forward: list of (input_pos, num_new)

    def __call__(self, seqs):
        info = self.info
        assert 1 <= len(seqs) <= info.max_batch_size
        assert sum(len(s.token_ids) for s in seqs) <= info.max_num_tokens
        all_pages = [p for s in seqs for p in s.pages]
        assert len(all_pages) == len(set(all_pages)), "two sequences share a page"
        assert len(all_pages) <= info.num_pages
        batch = info.build(seqs)  # the same validation the real graph's inputs get
        assert batch.num_seqs == len(seqs)
        self.calls.append([(s.input_pos, len(s.token_ids)) for s in seqs])
        logits = torch.zeros(len(seqs), VOCAB)
        for i, s in enumerate(seqs):
            for j, tok in enumerate(s.token_ids):
                pos = s.input_pos + j
                self.cache[s.pages[pos // info.page_size], pos % info.page_size] = tok
            end = s.input_pos + len(s.token_ids)
            history = [int(self.cache[s.pages[p // info.page_size], p % info.page_size]) for p in range(end)]
            logits[i, next_token(history)] = 10.0
        return logits


def make(max_batch_size=4, max_seq_len=32, page_size=4, num_pages=32, max_num_tokens=None, **kw):
    info = SequenceInfo(max_batch_size, max_seq_len, page_size, num_pages, max_num_tokens=max_num_tokens)
    model = FakeModel(info)
    return Scheduler(info, model, vocab_size=VOCAB, **kw), model


GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21, 22]]


def test_continuous_batching_joins_and_leaves():
    sched, model = make(max_batch_size=2)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (2, 6, 3, 5, 1, 4)]
    reqs = [sched.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    sched.run()
    for r, p, sp in zip(reqs, PROMPTS, params):
        assert r.output_token_ids == oracle(p, sp.max_tokens) and r.finish_reason == "length"
    # a new request's prefill shares a forward with another's decode
    assert any(any(n > 1 for _, n in call) and any(n == 1 and pos > 0 for pos, n in call) for call in model.calls)
    assert max(len(c) for c in model.calls) == 2
    assert sched.pool.num_free == sched.info.num_pages and not sched.running and not sched.waiting


def test_queueing_when_the_cache_is_full_and_page_reuse():
    # 3 pages of 4 tokens: the first request needs 3 (9 tokens), the others 2 each: one runs at a time
    sched, model = make(num_pages=3)
    reqs = [sched.add_request(p, GREEDY) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[4])]
    pages, concurrent = {}, []
    while sched.has_unfinished():
        sched.step()
        concurrent.append(len(sched.running))
        for r in sched.running:
            pages.setdefault(r.request_id, list(r.pages))
        assert sched.num_pages_in_use <= 3
    assert max(concurrent) == 1 and sched.max_pages_in_use == 3
    for r, p in zip(reqs, (PROMPTS[0], PROMPTS[2], PROMPTS[4])):
        assert r.output_token_ids == oracle(p, 6)  # stale tokens of the previous owner never leak
    assert sorted(pages) == [0, 1, 2] and [len(pages[i]) for i in range(3)] == [3, 2, 2]
    assert all(set(v) <= {0, 1, 2} for v in pages.values())  # freed pages are reused
    assert sched.pool.num_free == 3


def test_budget_holds_two_sequences():
    sched, model = make(num_pages=5, page_size=4)  # 20 tokens; prompt+6 <= 12 -> 2-3 pages each
    reqs = [sched.add_request(p, GREEDY) for p in PROMPTS]
    sched.run()
    for r, p in zip(reqs, PROMPTS):
        assert r.output_token_ids == oracle(p, 6)
    assert max(len(c) for c in model.calls) == 2 and sched.max_pages_in_use <= 5


def test_chunked_prefill_respects_max_num_tokens():
    sched, model = make(max_num_tokens=4, max_seq_len=64)
    long = list(range(1, 15))
    reqs = [sched.add_request(long, GREEDY), sched.add_request([3, 4], GREEDY)]
    sched.run()
    assert reqs[0].output_token_ids == oracle(long, 6) and reqs[1].output_token_ids == oracle([3, 4], 6)
    assert all(sum(n for _, n in call) <= 4 for call in model.calls)
    assert model.calls[0] == [(0, 4)] and model.calls[1] == [(4, 4)]  # the long prompt in chunks


def test_stop_tokens_eos_and_ignore_eos():
    prompt = [5, 6, 7]
    full = oracle(prompt, 8)
    stop = full[2]
    sched, _ = make(eos_token_ids=[stop])
    a = sched.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
    b = sched.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    c = sched.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                 stop_token_ids=[full[1]]))
    d = sched.add_request(prompt, SamplingParams(temperature=0, max_tokens=None))
    sched.run()
    assert a.output_token_ids == full[: full.index(stop) + 1] and a.finish_reason == "eos"
    assert b.output_token_ids == full and b.finish_reason == "length"
    assert c.output_token_ids == full[:2] and c.finish_reason == "stop"
    assert d.finish_reason == "eos"
    sched2, _ = make(max_seq_len=16)
    e = sched2.add_request(prompt, SamplingParams(temperature=0, max_tokens=None))
    sched2.run()
    assert e.output_token_ids == oracle(prompt, 13) and e.finish_reason == "length"  # up to max_seq_len


@pytest.mark.parametrize("prompt, params, message", [
    ([], GREEDY, "empty"),
    (list(range(1, 34)), GREEDY, "max_seq_len=32"),
    (list(range(1, 30)), SamplingParams(temperature=0, max_tokens=4), "max_tokens=4 = 33, more than max_seq_len=32"),
    ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_k=-2), "top_k"),
    ([1, 99], GREEDY, "vocab_size=50"),
])
def test_bad_requests_are_rejected_and_others_served(prompt, params, message):
    sched, _ = make()
    good1 = sched.add_request([1, 2, 3], GREEDY)
    bad = sched.add_request(prompt, params)
    good2 = sched.add_request([4, 5], GREEDY)
    assert bad.finished and bad.finish_reason == "rejected" and message in bad.error
    outs = sched.run()
    assert any(o.request is bad and o.finished and o.new_token_id is None for o in outs)
    assert good1.output_token_ids == oracle([1, 2, 3], 6) and good2.output_token_ids == oracle([4, 5], 6)
    assert bad.output_token_ids == []


def test_request_larger_than_the_whole_cache_is_rejected():
    sched, _ = make(num_pages=2, page_size=4)  # 8 tokens in all
    bad = sched.add_request([1, 2, 3, 4, 5], GREEDY)  # 11 tokens
    ok = sched.add_request([1], SamplingParams(temperature=0, max_tokens=7))
    assert bad.finish_reason == "rejected" and "kv_cache max_tokens=8" in bad.error
    sched.run()
    assert ok.output_token_ids == oracle([1], 7)


def test_seeded_sampling_same_tokens_alone_or_batched():
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=8)

    class Noisy(FakeModel):
        def __call__(self, seqs):
            logits = super().__call__(seqs)
            return logits / 10 + torch.linspace(0, 1, VOCAB)  # a spread distribution

    def run(prompts):
        info = SequenceInfo(4, 32, 4, 32)
        sched = Scheduler(info, Noisy(info))
        reqs = [sched.add_request(p, params) for p in prompts]
        sched.run()
        return [r.output_token_ids for r in reqs]

    alone = run([[1, 2, 3]])[0]
    batched = run([[9, 9], [1, 2, 3], [4]])
    assert batched[1] == alone and len(set(alone)) > 1


def test_running_requests_hold_distinct_state_slots_given_back_when_they_finish():
    info = SequenceInfo(2, 32, 4, 32)
    seen = []

    def forward(seqs):
        slots = [s.slot for s in seqs]
        assert len(set(slots)) == len(slots) and all(0 <= s < 2 for s in slots), slots
        seen.append(slots)
        return torch.zeros(len(seqs), VOCAB)

    sched = Scheduler(info, forward, has_state_cache=True, enable_prefix_caching=True)
    assert not sched.prefix_caching  # a page does not hold the state after a prefix
    reqs = [sched.add_request([1, 2, 3], SamplingParams(max_tokens=n)) for n in (1, 3, 2)]
    sched.run()
    assert all(r.finished and r.slot is None for r in reqs)
    # the first request finishes after one step: the third, admitted next, gets its slot 0
    assert seen[:2] == [[0, 1], [1, 0]] and sorted(sched._free_slots) == [0, 1]

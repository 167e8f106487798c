"""Multi-step decode (runtime/scheduler.py, point 5): several decode forwards within one scheduler step, through
``forward_next`` (the last decode batch advanced in place) or ``forward_greedy`` (several greedy steps in one call),
give the tokens, finish reasons and forwards of one forward per step.

The fake model reads only the graph's input tensors: it writes each new token into its own paged "cache" at the
slot ``page_table`` and ``position_ids`` name, and its next token is a function of the whole history read back
through the page table, so a wrong token, position, input_pos or page row in an advanced batch changes the output."""

from __future__ import annotations

import time

import pytest
import torch

from autodeploy import LLM
from autodeploy.errors import AutoDeployError
from autodeploy.runtime.engine import DECODE_STEPS_ENV, decode_steps_from_env
from autodeploy.runtime.sampler import SamplingParams
from autodeploy.runtime.scheduler import Interrupt, Scheduler
from autodeploy.runtime.sequence_info import SequenceInfo, SequenceRequest

VOCAB = 50


def next_token(history: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(history)) * 7 + len(history)) % VOCAB


class TensorModel:
    """A cached "graph" over the batch tensors (see the module docstring), with the multi-step entry points."""

    def __init__(self, info: SequenceInfo, noise: bool = False):
        self.info = info
        self.cache = torch.full((info.num_pages, info.page_size), -1, dtype=torch.long)
        self.noise = noise  # non-greedy tests: logits that leave several tokens likely
        self.forwards = 0
        self.greedy_calls: list[int] = []  # steps run per forward_greedy call

    def _run(self, batch) -> torch.Tensor:
        self.forwards += 1
        ids, positions, table = batch.input_ids[0].tolist(), batch.position_ids[0].tolist(), batch.page_table
        size, start, rows = self.info.page_size, 0, []
        for i, (n, cached) in enumerate(zip(batch.seq_lens.tolist(), batch.input_pos.tolist())):
            for j in range(n):
                pos = positions[start + j]
                assert pos == cached + j
                self.cache[table[i, pos // size], pos % size] = ids[start + j]
            history = [int(self.cache[table[i, p // size], p % size]) for p in range(cached + n)]
            row = torch.zeros(VOCAB)
            if self.noise:
                row = torch.linspace(0, 2, VOCAB).roll(next_token(history))
            row[next_token(history)] = 3.0
            rows.append(row)
            start += n
        return torch.stack(rows)

    def forward(self, seqs: list[SequenceRequest]) -> torch.Tensor:
        assert not any(s.all_logits for s in seqs)
        return self._run(self.info.build(seqs, gather="last", reuse=True))

    def forward_next(self, tokens: list[int]) -> torch.Tensor | None:
        batch = self.info.advance(tokens)
        return None if batch is None else self._run(batch)

    def forward_greedy(self, tokens, stop_tokens, steps, seconds, interrupt):
        """What DecodeLoop::greedy_steps does (decode_loop.h), over this model."""
        if self.info.decode_capacity() is None:
            return None
        rows, deadline = [], time.perf_counter() + seconds
        while len(rows) < steps and not (rows and time.perf_counter() >= deadline):
            if interrupt is not None and interrupt.is_set():
                break
            batch = self.info.advance(tokens)
            if batch is None:
                break
            tokens = self._run(batch).argmax(-1).tolist()
            rows.append(tokens)
            if any(t in stops for t, stops in zip(tokens, stop_tokens)):
                break
        self.greedy_calls.append(len(rows))
        return rows


def make(decode_steps: int, greedy: bool = False, noise: bool = False, page_size: int = 16, **kw):
    info = SequenceInfo(kw.pop("max_batch_size", 4), 48, page_size, 64)
    model = TensorModel(info, noise)
    sched = Scheduler(info, model.forward, vocab_size=VOCAB, forward_next=model.forward_next,
                      decode_steps=decode_steps, forward_greedy=model.forward_greedy if greedy else None, **kw)
    return sched, model


def serve(sched: Scheduler, prompts, params) -> tuple[list, list[int]]:
    """Every request's tokens and finish reason, and the forwards each step ran."""
    reqs = [sched.add_request(p, sp) for p, sp in zip(prompts, params)]
    forwards = []
    while sched.has_unfinished():
        before = sched.num_steps
        sched.step()
        forwards.append(sched.num_steps - before)
    return [(r.output_token_ids, r.finish_reason) for r in reqs], forwards


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]


def greedy_params(stop=None):
    """Different lengths; request 1 has ``stop`` as its stop tokens, request 3 alone stops at EOS."""
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=i != 3,
                           stop_token_ids=stop or [] if i == 1 else []) for i, n in enumerate((9, 30, 17, 30))]


def first_new_token(tokens: list[int], start: int = 8) -> int:
    """The first token from ``start`` on that ``tokens`` has not had before (sampling it ends a request there)."""
    return next(t for i, t in enumerate(tokens) if i >= start and t not in tokens[:i])


@pytest.mark.parametrize("greedy", [False, True], ids=["forward_next", "forward_greedy"])
@pytest.mark.parametrize("decode_steps", [2, 5, 32])
def test_several_decode_forwards_a_step_give_the_tokens_of_one_forward_a_step(greedy, decode_steps):
    reference = serve(make(1)[0], PROMPTS, greedy_params())[0]
    stop, eos = first_new_token(reference[1][0]), first_new_token(reference[3][0])  # sampled mid-way
    expected, forwards_1 = serve(make(1, eos_token_ids=[eos])[0], PROMPTS, greedy_params([stop]))
    assert [reason for _, reason in expected] == ["length", "stop", "length", "eos"]

    sched, model = make(decode_steps, greedy=greedy, eos_token_ids=[eos])
    got, forwards = serve(sched, PROMPTS, greedy_params([stop]))
    assert got == expected
    assert sum(forwards) == sum(forwards_1)  # the same forwards, fewer steps
    # a run of forwards ends where the page table needs a column: at most a page of 16 positions here
    assert max(forwards) == decode_steps if decode_steps < 8 else 8 <= max(forwards) <= 16
    assert len(forwards) < len(forwards_1)
    assert bool(model.greedy_calls) == greedy
    assert sched.pool.num_free == sched.info.num_pages and not sched.running  # every page given back


def test_seeded_sampling_draws_the_same_tokens():
    """Non-greedy requests run their extra forwards one at a time (forward_next), one draw per token."""
    params = [SamplingParams(temperature=1.0, top_k=20, seed=s, max_tokens=20, ignore_eos=True) for s in range(4)]
    expected, _ = serve(make(1, noise=True)[0], PROMPTS, params)
    sched, model = make(8, greedy=True, noise=True)
    got, forwards = serve(sched, PROMPTS, params)
    assert got == expected and max(forwards) == 8
    assert not model.greedy_calls  # forward_greedy is for greedy batches only
    assert len({tuple(t) for t, _ in got}) == 4


def test_a_page_boundary_ends_the_run_and_the_next_step_builds_a_wider_table():
    sched, model = make(32, greedy=True, page_size=4, max_batch_size=1)
    got, forwards = serve(sched, [[1, 2, 3]], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)])
    assert got[0][0] == serve(make(1, page_size=4, max_batch_size=1)[0], [[1, 2, 3]],
                              [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)])[0][0][0]
    # a table of 2 pages (the smallest width here) covers positions up to 7, then each page 4 more
    assert max(forwards) < 32 and sum(forwards) == 40


def test_requests_waiting_to_be_admitted_keep_one_forward_a_step():
    sched, _ = make(16, greedy=True, max_batch_size=1)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 2
    reqs = [sched.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params)]
    while reqs[1].status == "waiting":
        before = sched.num_steps
        sched.step()
        assert sched.num_steps - before == 1
    assert len(reqs[0].output_token_ids) == 10  # the second is admitted once the first finished
    sched.run()
    assert len(reqs[1].output_token_ids) == 10


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                                    SamplingParams(temperature=0, max_tokens=12, min_tokens=12, stop_token_ids=[3])],
                         ids=["logprobs", "min_tokens"])
def test_logprobs_and_min_tokens_keep_one_forward_a_step(params):
    sched, _ = make(8, greedy=True)
    _, forwards = serve(sched, PROMPTS[:2], [params] * 2)
    assert max(forwards) == 1


def test_an_interrupt_or_the_time_limit_ends_the_step_early():
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2
    expected, _ = serve(make(1)[0], PROMPTS[:2], params)
    for greedy in (False, True):
        interrupted, model = make(8, greedy=greedy)
        interrupted.interrupt = Interrupt()
        interrupted.interrupt.set()  # a server with something new to admit
        got, forwards = serve(interrupted, PROMPTS[:2], params)
        assert got == expected and max(forwards) == 1
        assert bool(model.greedy_calls) == greedy and not any(model.greedy_calls)  # asked, and ran nothing
    for greedy in (False, True):
        timed, _ = make(8, greedy=greedy, decode_seconds=0.0)  # each run of forwards stops after its first
        got, forwards = serve(timed, PROMPTS[:2], params)
        assert got == expected and max(forwards) <= 2 and len(forwards) < 20


def test_the_sequence_info_advances_a_decode_batch_in_place():
    info = SequenceInfo(2, 32, 4, 16)
    batch = info.build([SequenceRequest([5], 6, [3, 4, 9]), SequenceRequest([8], 2, [7, 1])], reuse=True, min_width=2)
    assert info.decode_capacity() == 8  # two columns of 4
    assert info.advance([11, 12]) is batch
    assert batch.input_ids.tolist() == [[11, 12]] and batch.position_ids.tolist() == [[7, 3]]
    assert batch.input_pos.tolist() == [7, 3] and batch.page_table.tolist() == [[3, 4], [7, 1]]
    assert info.advance([1, 2]) is None  # position 8 needs a third column: nothing written
    assert batch.input_ids.tolist() == [[11, 12]] and batch.position_ids.tolist() == [[7, 3]]
    info.build([SequenceRequest([1, 2], 0, [0])])  # a prefill: no decode batch to advance
    assert info.decode_capacity() is None and info.advance([3]) is None


def test_decode_steps_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(DECODE_STEPS_ENV, "4")
    assert decode_steps_from_env() == 4
    for bad in ("0", "many"):
        monkeypatch.setenv(DECODE_STEPS_ENV, bad)
        with pytest.raises(AutoDeployError, match=f"{DECODE_STEPS_ENV}='{bad}': it must be an integer >= 1"):
            decode_steps_from_env()
        with pytest.raises(AutoDeployError, match=DECODE_STEPS_ENV):  # before anything is built or read
            LLM("/nonexistent/checkpoint")
    with pytest.raises(ValueError, match="decode_steps must be >= 1"):
        make(0)

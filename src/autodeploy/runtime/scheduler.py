"""Continuous batching over a paged KV cache.

Requests wait in a FIFO queue. Each :meth:`Scheduler.step` is one forward of the cached graph (or several decode
forwards, point 5):

1. the running requests go first, in arrival order: a decoding request gets its one new token, a
   request still in (chunked) prefill gets the next chunk of its prompt, as far as ``max_num_tokens``
   allows;
2. then waiting requests are admitted, in arrival order, while the batch has room
   (``max_batch_size``), the token budget has room (their prompt is chunked to what is left of it) and
   the :class:`~autodeploy.runtime.sequence_info.PagePool` has the pages the request will ever need
   (``prompt + max_tokens`` tokens, reserved at admission, so a running request never runs out of
   cache and nothing is ever preempted). When the head of the queue does not fit, admission stops
   (first come, first served): requests wait for pages instead of failing;
3. the forward runs (``forward(list[SequenceRequest]) -> logits [num_seqs, vocab]``, each sequence's
   last new token), and every request whose tokens are now all cached samples its next token;
4. finished requests (``max_tokens`` reached, a stop token, the EOS token unless ``ignore_eos``) leave
   and their pages go back to the pool;
5. multi-step decode: where that forward was a decode step (one new token per sequence), nothing waits to be
   admitted and every request of it runs on without logprobs or ``min_tokens`` suppression, more decode steps of
   the same sequences follow within the same :meth:`step`, each through ``forward_next(tokens)`` (the previous
   forward's inputs one token on, without building the batch again): up to ``decode_steps`` forwards in all, and
   none started after ``decode_seconds`` (so a stream gets its tokens at least that often). They stop early
   where a request finishes, ``forward_next`` returns None (the page table is too narrow for the next position)
   or another thread raises ``interrupt`` (an :class:`Interrupt`: a server with new requests to admit). Where
   every request is greedy, ``forward_greedy`` runs those steps in one call instead (a served package's C++ loop,
   which reads the same flag).
   While the running batch stays the same and nothing waits, the next :meth:`step` runs it on at once, without
   scheduling or building it. The tokens are those of as many single steps; only the time between two forwards
   is less (docs/performance.md).

Each running request also holds a state-cache slot (``Request.slot``, one of ``max_batch_size``), taken at
admission and given back when it finishes: graphs with state-space layers keep a sequence's recurrent
state there (the cached op starts a sequence admitted into a used slot from the zero state).

With ``enable_prefix_caching`` (:mod:`autodeploy.runtime.prefix_cache`), an admitted request first takes
the pages already computed for the longest cached prefix of its prompt and starts its prefill after
them; its own full prompt pages are published for later requests as they are computed. A request that
asks for ``prompt_logprobs`` computes its whole prompt (it needs every position's logits).

Per request, ``min_tokens`` keeps EOS and stop tokens from being sampled before that many tokens, and
``logprobs`` / ``prompt_logprobs`` record :class:`~autodeploy.runtime.sampler.TokenLogprob` entries
(``Request.logprobs``, ``Request.prompt_logprobs``; ``StepOutput.logprob``). Stop *strings* need text:
the engine checks them and ends the request with :meth:`Scheduler.abort` (``reason="stop"``).

A request that can never run (empty prompt, longer than ``max_seq_len``, ``prompt + max_tokens`` over
``max_seq_len`` or over the whole KV cache, invalid sampling values, token ids outside the vocabulary)
is rejected when added: it finishes at once with ``finish_reason="rejected"`` and an ``error`` message,
and the others are served as usual. Everything is deterministic given the forward and the seeds.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .prefix_cache import PrefixCachingPool
from .sampler import SamplingParams, TokenLogprob, make_generator, sample, suppress_tokens, token_logprobs
from .sequence_info import PagePool, SequenceInfo, SequenceRequest

#: ``forward(requests) -> logits [len(requests), vocab]`` (each sequence's last new token)
ForwardFn = Callable[[list[SequenceRequest]], torch.Tensor]
#: ``forward_next(tokens) -> logits [len(tokens), vocab]``: the previous decode forward's sequences one token on
#: (sequence i's new token ``tokens[i]``), or None where that batch cannot take the next positions
ForwardNextFn = Callable[[list[int]], "torch.Tensor | None"]
#: ``forward_greedy(tokens, stop_tokens, steps, seconds, interrupt) -> rows``: up to ``steps`` such forwards, each fed
#: the argmax of the one before (``tokens`` first); one row of picked tokens per forward run, ending after a row where
#: sequence i picked one of ``stop_tokens[i]``, after the forward that passes ``seconds``, or before a position the
#: batch cannot take or a forward the ``interrupt`` (or None) is raised for; None where it cannot run at all
ForwardGreedyFn = Callable[[list[int], list[list[int]], int, float, "Interrupt | None"], "list[list[int]] | None"]

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
#: a step of several decode forwards runs no further forward once this long has passed: its tokens reach a stream
#: at least this often
DECODE_SECONDS = 0.05


class Interrupt:
    """A flag another thread raises to end a multi-step decode step before its next forward (a server with requests
    to admit). The scheduler reads it between forwards, a package's C++ loop through :attr:`tensor` (int32 [1])."""

    def __init__(self):
        self.tensor = torch.zeros(1, dtype=torch.int32)
        self._flag = self.tensor.numpy()

    def set(self) -> None:
        self._flag[0] = 1

    def clear(self) -> None:
        self._flag[0] = 0

    def is_set(self) -> bool:
        return bool(self._flag[0])


@dataclass
class Request:
    """One generation request and its progress."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    finish_reason: str | None = None  # "length", "stop", "eos" or "rejected"
    error: str | None = None  # why it was rejected
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose k/v are in the cache
    slot: int | None = None  # state-cache slot while running
    max_tokens: int = 0  # resolved (SamplingParams.max_tokens or up to max_seq_len)
    generator: torch.Generator | None = None
    num_prefix_cached: int = 0  # prompt tokens whose pages came from the prefix cache
    output_text: str = ""  # set by the engine (detokenized, ends before a stop string)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, with params.logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


@dataclass
class StepOutput:
    """What one step produced for one request: a new token (None for a rejection) and whether it finished;
    ``logprob`` with ``params.logprobs``; ``text`` the new text (set by the engine, with a tokenizer);
    ``num_output_tokens``: the request's output tokens up to and including this one (a multi-step decode step
    gives a request several outputs)."""

    request: Request
    new_token_id: int | None
    finished: bool
    logprob: TokenLogprob | None = None
    text: str = ""
    num_output_tokens: int = 0


@dataclass
class ScheduledSeq:
    request: Request
    num_new: int  # tokens of the request fed in this step


class Scheduler:
    """Continuous batching (see the module docstring). ``info`` gives the limits (max batch size, max
    sequence length, page size, number of pages, ``max_num_tokens``); ``forward`` runs the model: it returns
    one row of logits per sequence, or one per new token for a sequence with ``all_logits``. With
    ``forward_next`` and ``decode_steps > 1``, a step may run several decode forwards (multi-step decode, see the
    module docstring); ``interrupt``, where set, is read before each of the extra ones."""

    def __init__(
        self,
        info: SequenceInfo,
        forward: ForwardFn,
        eos_token_ids: Sequence[int] | int | None = None,
        vocab_size: int | None = None,
        sampler: Callable = sample,
        enable_prefix_caching: bool = False,
        has_state_cache: bool = False,
        forward_next: ForwardNextFn | None = None,
        decode_steps: int = 1,
        forward_greedy: ForwardGreedyFn | None = None,
        decode_seconds: float = DECODE_SECONDS,
    ):
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        if info.num_pages < 1:
            raise ValueError("the KV cache has no pages: allocate it (initialize_cache) before serving")
        self.info = info
        self.forward, self.forward_next, self.forward_greedy = forward, forward_next, forward_greedy
        self.decode_steps, self.decode_seconds = decode_steps, decode_seconds
        self._decoding: list[Request] | None = None  # the last step's decode batch, where it may run on as it is
        self.interrupt: Interrupt | None = None
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.eos_token_ids = set(eos_token_ids or ())
        self.vocab_size = vocab_size
        self.sampler = sampler
        # a shared prefix page holds k/v, not the recurrent state after the prefix: no prefix caching
        self.has_state_cache = has_state_cache
        self.set_prefix_caching(enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._rejected: list[Request] = []
        self._ids = itertools.count()
        self._free_slots = list(range(info.max_batch_size - 1, -1, -1))  # pop() hands out low slots first
        self.num_steps = 0
        self.max_pages_in_use = 0  # high-water mark, for tests and stats

    def set_prefix_caching(self, enabled: bool) -> None:
        """Switch prefix caching on or off (a fresh page pool: only while no request is unfinished). A graph
        with a state cache (state-space layers) never shares prefixes: the switch stays off."""
        if getattr(self, "running", None) or getattr(self, "waiting", None):
            raise RuntimeError("prefix caching can only be switched while no request is running or waiting")
        enabled = enabled and not self.has_state_cache
        self.prefix_caching = enabled
        self.pool = PrefixCachingPool(self.info.num_pages, self.info.page_size) if enabled else PagePool(
            self.info.num_pages)

    # -- requests ---------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> str | None:
        """Why this request can never be served (a message naming the limit), or None."""
        problem = params.problem()
        if problem:
            return problem
        n, info = len(prompt_token_ids), self.info
        if n == 0:
            return "the prompt is empty: it needs at least one token"
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
            return "prompt token ids must be integers"
        if self.vocab_size is not None:
            bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                return f"prompt token id(s) {bad[:5]} outside the vocabulary of vocab_size={self.vocab_size}"
        if n > info.max_seq_len:
            return f"the prompt has {n} tokens, more than max_seq_len={info.max_seq_len}"
        if params.max_tokens is None:
            if n >= info.max_seq_len:
                return f"the prompt has {n} tokens, no room to generate within max_seq_len={info.max_seq_len}"
        elif n + params.max_tokens > info.max_seq_len:
            return (f"the prompt has {n} tokens + max_tokens={params.max_tokens} = {n + params.max_tokens}, "
                    f"more than max_seq_len={info.max_seq_len}")
        total = n + self._max_tokens(n, params)
        needed = info.pages_needed(total)
        if needed > info.num_pages:
            return (f"the prompt + max_tokens need {total} tokens ({needed} KV-cache pages of {info.page_size}), "
                    f"more than the whole KV cache holds (kv_cache max_tokens={info.num_pages * info.page_size})")
        return None

    def _max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        return params.max_tokens if params.max_tokens is not None else self.info.max_seq_len - num_prompt

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> Request:
        """Queue a request; an invalid one is finished at once (``finish_reason="rejected"``, ``error``)
        and reported by the next :meth:`step`."""
        params = params if params is not None else SamplingParams()
        prompt = list(prompt_token_ids)
        req = Request(next(self._ids), prompt, params)
        req.error = self.check_request(prompt, params)
        if req.error is not None:
            req.status, req.finish_reason = FINISHED, "rejected"
            self._rejected.append(req)
            return req
        req.max_tokens = self._max_tokens(len(prompt), params)
        req.generator = None if params.greedy else make_generator(params.seed)
        self.waiting.append(req)
        return req

    def abort(self, request: Request, reason: str = "aborted") -> None:
        """End a request (waiting or running) with ``finish_reason=reason`` and free its pages."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._release(request, reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._rejected)

    @property
    def num_pages_in_use(self) -> int:
        return self.info.num_pages - self.pool.num_free

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's sequences (running first, then admissions); allocates admitted pages."""
        info = self.info
        budget = info.max_num_tokens
        batch: list[ScheduledSeq] = []
        for req in self.running:
            if len(batch) >= info.max_batch_size or budget <= 0:
                break
            n = min(req.num_tokens - req.num_cached, budget)
            batch.append(ScheduledSeq(req, n))
            budget -= n
        while self.waiting and len(batch) < info.max_batch_size and budget > 0:
            req = self.waiting[0]
            shared = self._cached_prefix(req)
            needed = info.pages_needed(len(req.prompt_token_ids) + req.max_tokens) - len(shared)
            if shared and needed > self.pool.num_free - self.pool.num_unreferenced(shared):
                shared, needed = [], needed + len(shared)  # the hit does not fit: try without it
            if needed > self.pool.num_free:
                break  # first come, first served: wait for pages
            self.waiting.popleft()
            if shared:
                self.pool.acquire(shared)
            req.pages = shared + self.pool.allocate(needed)
            req.slot = self._free_slots.pop()  # running requests never exceed max_batch_size
            req.num_cached = req.num_prefix_cached = len(shared) * info.page_size
            req.status = RUNNING
            self.running.append(req)
            n = min(len(req.prompt_token_ids) - req.num_cached, budget)
            batch.append(ScheduledSeq(req, n))
            budget -= n
        self.max_pages_in_use = max(self.max_pages_in_use, self.num_pages_in_use)
        return batch

    def _cached_prefix(self, req: Request) -> list[int]:
        if not self.prefix_caching or req.params.prompt_logprobs is not None:
            return []
        return self.pool.match(req.prompt_token_ids)

    def _publish(self, req: Request, start: int) -> None:
        """Publish the request's prompt pages completed by the tokens cached since ``start``."""
        size = self.info.page_size
        end = min(req.num_cached, len(req.prompt_token_ids))
        for i in range(start // size, end // size):
            self.pool.publish(req.pages[i], req.prompt_token_ids[: (i + 1) * size])

    def step(self) -> list[StepOutput]:
        """Run one forward over the scheduled sequences and sample, or several decode forwards (point 5 of the
        module docstring); returns the new tokens and finishes, in order."""
        outputs = [StepOutput(r, None, True) for r in self._rejected]
        self._rejected = []
        if self._decoding is not None and self._still_decoding(self._decoding):
            # the last step's decode batch runs on as it is (multi-step decode)
            if self._decode_more(self._decoding, self.decode_steps, outputs):
                return outputs
        self._decoding = None
        batch = self.schedule()
        if not batch:
            if self.waiting and not self.running:  # cannot happen: check_request bounds every request
                raise RuntimeError("the scheduler cannot admit the next request")
            return outputs
        seqs = [
            SequenceRequest(s.request.all_token_ids[s.request.num_cached : s.request.num_cached + s.num_new],
                            s.request.num_cached, s.request.pages, self._wants_prompt_logits(s.request),
                            s.request.slot)
            for s in batch
        ]
        logits = self.forward(seqs)
        self.num_steps += 1
        ready, last_rows, row = [], [], 0
        for s, seq in zip(batch, seqs):
            req, start = s.request, s.request.num_cached
            if seq.all_logits:
                self._record_prompt_logprobs(req, logits[row : row + s.num_new], start)
            row += s.num_new if seq.all_logits else 1
            req.num_cached += s.num_new
            if self.prefix_caching:
                self._publish(req, start)
            if req.num_cached == req.num_tokens:
                ready.append(req)
                last_rows.append(row - 1)
        if ready:
            # every row ready (always in decode): sample from the logits as they are, without indexing out a
            # copy of them every step (the cost of that copy: docs/performance.md)
            rows = logits if len(ready) == logits.shape[0] else logits[last_rows]
            suppressed = suppress_tokens(rows, [(i, self._suppressed(r)) for i, r in enumerate(ready)])
            tokens = self.sampler(suppressed, [r.params for r in ready], [r.generator for r in ready])
            logprobs = self._logprobs(rows, ready, tokens)
            for req, tok, logprob in zip(ready, tokens, logprobs):
                req.output_token_ids.append(tok)
                if logprob is not None:
                    req.logprobs.append(logprob)
                reason = self._finish_reason(req, tok)
                if reason:
                    self.running.remove(req)
                    self._release(req, reason)
                outputs.append(StepOutput(req, tok, reason is not None, logprob,
                                          num_output_tokens=len(req.output_token_ids)))
            if self._decodes_on(batch, seqs, ready):
                self._decode_more(ready, self.decode_steps - 1, outputs)
        return outputs

    def _decodes_on(self, batch: list[ScheduledSeq], seqs: list[SequenceRequest], ready: list[Request]) -> bool:
        """Whether this step's decode batch runs on for more steps (multi-step decode, the module docstring):
        every running request was in it with one new token, and sampled."""
        if self.decode_steps < 2 or self.forward_next is None or self.waiting:
            return False
        if not len(ready) == len(batch) == len(self.running):
            return False
        return all(s.num_new == 1 and not seq.all_logits and not s.request.finished
                   and s.request.params.logprobs is None
                   and len(s.request.output_token_ids) >= s.request.params.min_tokens
                   for s, seq in zip(batch, seqs))

    def _still_decoding(self, reqs: list[Request]) -> bool:
        """Whether the running batch is still ``reqs`` (the last step's decode batch) and nothing waits: the next
        step runs it on without scheduling or building it again."""
        running = self.running
        return not self.waiting and len(running) == len(reqs) and all(a is b for a, b in zip(running, reqs))

    def _decode_more(self, reqs: list[Request], steps: int, outputs: list[StepOutput]) -> bool:
        """Up to ``steps`` more decode steps of ``reqs`` (each fed the token it sampled last), while all of them run
        and for at most ``decode_seconds``: their outputs are appended to ``outputs``. False where not one step
        could run (the batch needs building again)."""
        steps = min(steps, *(r.max_tokens - len(r.output_token_ids) for r in reqs))
        tokens = [r.output_token_ids[-1] for r in reqs]
        params, generators = [r.params for r in reqs], [r.generator for r in reqs]
        self._decoding = None
        if self.forward_greedy is not None and all(p.greedy for p in params):
            rows = self.forward_greedy(tokens, [self._stop_tokens(r) for r in reqs], steps, self.decode_seconds,
                                       self.interrupt)
            if rows is not None:
                for row in rows:
                    self.num_steps += 1
                    if self._record_decoded(reqs, row, outputs):
                        return True
                self._decoding = reqs if rows else None
                return bool(rows)
        deadline, done = time.perf_counter() + self.decode_seconds, 0
        while done < steps and not (done and time.perf_counter() >= deadline):
            if self.interrupt is not None and self.interrupt.is_set():
                break
            logits = self.forward_next(tokens)
            if logits is None:
                return done > 0
            self.num_steps += 1
            done += 1
            tokens = self.sampler(logits, params, generators)
            if self._record_decoded(reqs, tokens, outputs):
                return True
        self._decoding = reqs if done else None
        return done > 0

    def _record_decoded(self, reqs: list[Request], tokens: list[int], outputs: list[StepOutput]) -> bool:
        """One more decode step's tokens of ``reqs`` (all past ``min_tokens``); True where one of them finished."""
        finished = False
        for req, tok in zip(reqs, tokens):
            req.num_cached += 1
            req.output_token_ids.append(tok)
            reason = self._finish_reason(req, tok)
            if reason:
                self.running.remove(req)
                self._release(req, reason)
                finished = True
            outputs.append(StepOutput(req, tok, reason is not None, num_output_tokens=len(req.output_token_ids)))
        return finished

    def _stop_tokens(self, req: Request) -> list[int]:
        """The tokens that end ``req`` once past ``min_tokens``: its stop tokens, and EOS unless ``ignore_eos``."""
        eos = [] if req.params.ignore_eos else sorted(self.eos_token_ids)
        return eos + list(req.params.stop_token_ids)

    @staticmethod
    def _wants_prompt_logits(req: Request) -> bool:
        return req.params.prompt_logprobs is not None and req.num_cached < len(req.prompt_token_ids)

    @staticmethod
    def _record_prompt_logprobs(req: Request, rows: torch.Tensor, start: int) -> None:
        """Row j predicts prompt token start + j + 1 (the last prompt row predicts the first output)."""
        prompt = req.prompt_token_ids
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        n = min(rows.shape[0], len(prompt) - 1 - start)
        if n > 0:
            req.prompt_logprobs.extend(
                token_logprobs(rows[:n], prompt[start + 1 : start + 1 + n], req.params.prompt_logprobs))

    def _suppressed(self, req: Request) -> list[int]:
        """Tokens that may not be sampled yet: EOS and stop tokens before ``min_tokens``."""
        return self._stop_tokens(req) if len(req.output_token_ids) < req.params.min_tokens else []

    @staticmethod
    def _logprobs(rows: torch.Tensor, reqs: list[Request], tokens: list[int]) -> list[TokenLogprob | None]:
        wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(reqs)
        for i in wanted:
            out[i] = token_logprobs(rows[i : i + 1], [tokens[i]], reqs[i].params.logprobs)[0]
        return out

    def _finish_reason(self, req: Request, token: int) -> str | None:
        if len(req.output_token_ids) < req.params.min_tokens:
            return "length" if len(req.output_token_ids) >= req.max_tokens else None
        if token in req.params.stop_token_ids:
            return "stop"
        if token in self.eos_token_ids and not req.params.ignore_eos:
            return "eos"
        if len(req.output_token_ids) >= req.max_tokens:
            return "length"
        return None

    def _release(self, req: Request, reason: str) -> None:
        if req.pages:
            self.pool.free(req.pages)
            req.pages = []
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None
        req.status, req.finish_reason = FINISHED, reason

    def run(self) -> list[StepOutput]:
        """Step until every request finished; all step outputs in order."""
        out = []
        while self.has_unfinished():
            out.extend(self.step())
        return out

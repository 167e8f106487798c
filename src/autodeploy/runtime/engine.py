"""The engine: serves a cached graph (the pipeline's output after ``cache_init``) with continuous batching
(:mod:`autodeploy.runtime.scheduler`) and per-request sampling (:mod:`autodeploy.runtime.sampler`).

:class:`Engine` rejects a request it cannot serve (``finish_reason="rejected"``, ``error``) and serves the
rest; :meth:`Engine.check` raises ``ValueError`` naming the first such request and its limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.fx import GraphModule

from ..errors import AutoDeployError
from ..utils.fx import named_graphmodules
from .host_memory import keep_freed_memory
from .kv_cache import KV_CACHE_META_KEY, KVCacheSpec
from .package import PackagedModel
from .sampler import SamplingParams, TokenLogprob
from .scheduler import Interrupt, Request, Scheduler
from .sequence_info import LOGITS_IDX, SLOT_IDX, SequenceInfo, SequenceRequest, logits_token_idx

Prompt = str | Sequence[int]

#: decode forwards one :meth:`Engine.step` may run (multi-step decode, :mod:`autodeploy.runtime.scheduler`);
#: ``1``: one forward per step
DECODE_STEPS_ENV = "AUTODEPLOY_DECODE_STEPS"
DEFAULT_DECODE_STEPS = 32


def decode_steps_from_env() -> int:
    """``AUTODEPLOY_DECODE_STEPS`` (default 32), checked."""
    value = os.environ.get(DECODE_STEPS_ENV, str(DEFAULT_DECODE_STEPS))
    try:
        steps = int(value)
    except ValueError:
        steps = 0
    if steps < 1:
        raise AutoDeployError(f"{DECODE_STEPS_ENV}={value!r}: it must be an integer >= 1 (1 runs one forward per "
                              f"engine step)")
    return steps


@dataclass
class CompletionOutput:
    """``logprobs``: one :class:`TokenLogprob` per generated token when the request asked for them
    (``SamplingParams.logprobs``), else None."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """One prompt's result: ``.prompt`` (the string, or None for token ids), ``.prompt_token_ids``,
    ``.outputs[0].token_ids`` / ``.text`` / ``.finish_reason``; ``.error`` when it was rejected."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: str | None = None


def find_cached_graph(mod: nn.Module) -> tuple[GraphModule, KVCacheSpec]:
    """The graph module holding the KV cache (``gm.meta['kv_cache']``) in ``mod``."""
    for _, gm in named_graphmodules(mod):
        if KV_CACHE_META_KEY in gm.meta:
            return gm, gm.meta[KV_CACHE_META_KEY]
    raise AutoDeployError(
        "the model has no KV cache: the runtime needs the cache_init stage (insert_cached_attention, "
        "insert_cached_ssm), which only applies to auto_deploy::torch_attention nodes and the state-space ops; "
        "check that the pattern_matcher stage matched the model's attention (see its log / AD_DUMP_GRAPHS_DIR dumps)"
    )


def served_graph_inputs(model: nn.Module) -> tuple[list[str], KVCacheSpec, int | None]:
    """The graph inputs (in order), the KV cache and the vocab size (None where unknown) of the module the
    runtime serves: a package's say so themselves, a graph module's are read off its graph."""
    if isinstance(model, PackagedModel):
        vocab = model.vocab_size
        if vocab is None and isinstance(model.general, GraphModule):
            vocab = _embedding_vocab(model.general)
        return model.input_names, model.kv_cache_spec, vocab
    gm, spec = find_cached_graph(model)
    return [n.name for n in gm.graph.find_nodes(op="placeholder")], spec, _embedding_vocab(gm)


def _embedding_vocab(gm: GraphModule) -> int | None:
    """Rows of the token-embedding table (first aten.embedding whose weight is a get_attr), if any."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default):
        weight = node.args[0]
        if getattr(weight, "op", None) == "get_attr":
            try:
                return int(gm.get_parameter(weight.target).shape[0])
            except AttributeError:
                try:
                    return int(gm.get_buffer(weight.target).shape[0])
                except AttributeError:
                    return None
    return None


class _Detokenizer:
    """Incremental text of one request, cut before its first stop string.

    :meth:`update` returns the new text since the previous call and whether a stop string was found.
    While a request runs, the last ``len(longest stop string) - 1`` characters are held back: they may be
    the start of a stop string, which is never returned."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text, self.emitted = "", ""

    def update(self, token_ids: list[int], final: bool, check_stop: bool = True) -> tuple[str, bool]:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:  # an incomplete UTF-8 sequence: wait for more tokens
            return "", False
        stopped = False
        if self.stop and check_stop:
            # a stop string can only end in the new text: search from where it could have started
            start = max(0, len(self.text) - self.holdback)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                text, stopped, final = text[: min(hits)], True, True
        self.text = text
        visible = text if final else text[: len(text) - self.holdback]
        if not visible.startswith(self.emitted):  # a merge changed earlier text: emit nothing, keep the full text
            self.emitted = visible
            return "", stopped
        delta, self.emitted = visible[len(self.emitted):], visible
        return delta, stopped


class Engine:
    """Serves a cached graph (the pipeline's output after ``cache_init``): continuous batching and sampling.

    ``model``: a module whose (sub)graph has ``meta['kv_cache']`` with allocated caches;
    ``tokenizer``: optional (HF tokenizer), for string prompts and output text;
    ``eos_token_ids``: tokens that end generation unless ``ignore_eos``;
    ``max_num_tokens``: tokens per forward (chunked prefill); default ``max_batch_size * max_seq_len``;
    ``vocab_size``: prompt token ids are checked against it (default: the embedding table's rows);
    ``enable_prefix_caching``: requests share the KV pages of common prompt prefixes
    (:mod:`autodeploy.runtime.prefix_cache`; the same tokens, less prefill); off for graphs with a state
    cache (state-space layers), whose state after a prefix no page holds;
    ``decode_steps``: decode forwards one :meth:`step` may run where every running request decodes (multi-step
    decode, :mod:`autodeploy.runtime.scheduler`: the same tokens, less Python between two forwards; CPU only);
    default ``AUTODEPLOY_DECODE_STEPS`` or 32, and no forward starts once 50 ms have passed. A server that
    admits requests between steps sets ``engine.scheduler.interrupt`` (an
    :class:`~autodeploy.runtime.scheduler.Interrupt` it raises) to end such a step early.

    :meth:`step` runs one forward, or several decode forwards; each :class:`StepOutput` carries the request's new
    text (``.text``, with a tokenizer), and a request whose text reaches one of its ``stop`` strings ends there
    (``finish_reason="stop"``, ``Request.output_text`` ends before it).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] | int | None = None,
        max_num_tokens: int | None = None,
        vocab_size: int | None = None,
        enable_prefix_caching: bool = True,
        decode_steps: int | None = None,
    ):
        inputs, spec, graph_vocab = served_graph_inputs(model)
        decode_steps = decode_steps_from_env() if decode_steps is None else decode_steps
        if spec.num_pages < 1:
            raise AutoDeployError("the KV cache is not allocated: run initialize_cache / resize_kv_cache first")
        if max_num_tokens is not None and max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self.model, self.spec, self.tokenizer = model, spec, tokenizer
        self.device = torch.device(spec.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's activations reuse mapped pages (host_memory.py)
        self.gathers = LOGITS_IDX in inputs
        # a module that widens narrower page tables (DecodeDispatch) gets them built that wide: no copy per step
        self._min_table_width = getattr(model, "min_table_width", 1)
        self.takes_slots = SLOT_IDX in inputs  # a state cache (state-space layers): one slot per sequence
        self.info = SequenceInfo(spec.max_batch_size, spec.max_seq_len, spec.page_size, spec.num_pages,
                                 max_num_tokens=max_num_tokens)
        if eos_token_ids is None and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos_token_ids = tokenizer.eos_token_id
        self.scheduler = Scheduler(self.info, self._forward, eos_token_ids,
                                   vocab_size if vocab_size is not None else graph_vocab,
                                   enable_prefix_caching=enable_prefix_caching,
                                   has_state_cache=bool(spec.state_layers),
                                   # the decode batch is advanced in place: only where build() reuses its tensors
                                   forward_next=self._forward_next if self.device.type == "cpu" else None,
                                   decode_steps=decode_steps,
                                   forward_greedy=self._forward_greedy if self.device.type == "cpu" and getattr(
                                       model, "greedy_steps", None) is not None else None)
        self._detok: dict[int, _Detokenizer] = {}
        self._batch, self._args = None, ()  # the last batch and its graph arguments (a reused batch keeps them)
        self._never = Interrupt()  # what the C++ loop reads where nothing can interrupt it

    @property
    def max_seq_len(self) -> int:
        return self.info.max_seq_len

    # -- the model ---------------------------------------------------------------------------------
    def _forward(self, seqs: list[SequenceRequest]) -> torch.Tensor:
        batch = self.info.build(seqs, gather="last" if self.gathers else None, device=self.device,
                                slots=self.takes_slots, min_width=self._min_table_width, reuse=True)
        logits = self._logits(batch)
        if not self.gathers:
            logits = logits[logits_token_idx(seqs).to(logits.device)]
        return logits if logits.dtype == torch.float32 else logits.float()

    def _forward_next(self, tokens: list[int]) -> torch.Tensor | None:
        """The last decode batch one token on (the scheduler's multi-step decode); None where it cannot be."""
        batch = self.info.advance(tokens)
        if batch is None:
            return None
        logits = self._logits(batch)  # one token per sequence: every row is a sequence's last token's
        return logits if logits.dtype == torch.float32 else logits.float()

    def _forward_greedy(self, tokens: list[int], stop_tokens: list[list[int]], steps: int, seconds: float,
                        interrupt: Interrupt | None) -> list[list[int]] | None:
        """Up to ``steps`` greedy decode steps of the last decode batch in one call of the model's
        ``greedy_steps`` (a served package's C++ loop, :data:`~autodeploy.runtime.scheduler.ForwardGreedyFn`);
        None where the last batch was not a reused decode batch."""
        capacity = self.info.decode_capacity()
        if capacity is None or self._batch is None:
            return None
        width = max(1, *(len(s) for s in stop_tokens))
        stops = torch.tensor([s + [-1] * (width - len(s)) for s in stop_tokens], dtype=torch.long)
        flag = (interrupt or self._never).tensor
        picked = self.model.greedy_steps(list(self._args), torch.tensor(tokens, dtype=torch.long), stops, steps,
                                         capacity, seconds, flag)
        return picked.tolist()

    def _logits(self, batch) -> torch.Tensor:
        """The model's logits rows for one batch (grad mode is off: :meth:`step`)."""
        if batch is not self._batch:  # a reused decode batch keeps its tensors, so its arguments too
            self._batch, self._args = batch, batch.as_args(include_logits_idx=self.gathers)
        out = self.model(*self._args)
        return (out[0] if isinstance(out, (tuple, list)) else out)[0]

    # -- requests ----------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (none found with the model); pass token ids instead")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.flatten().tolist()]
        return list(prompt)

    def _params_list(self, prompts: Sequence[Prompt], params) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return params

    def check(self, prompts: Sequence[Prompt], params=None) -> None:
        """Raise ``ValueError`` for the first request that cannot be served (naming the prompt and limit)."""
        for i, (prompt, p) in enumerate(zip(prompts, self._params_list(prompts, params))):
            try:
                problem = self.check_request(self.encode(prompt), p)
            except ValueError as exc:
                problem = str(exc)
            if problem:
                raise ValueError(f"prompt {i}: {problem}")

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None) -> str | None:
        """Why this request can never be served (a message naming the limit), or None."""
        params = params if params is not None else SamplingParams()
        if params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer (none found with the model); use stop_token_ids"
        return self.scheduler.check_request(prompt_token_ids, params)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> Request:
        """Queue one request (rejected at once when it cannot be served, see :class:`Scheduler`)."""
        try:
            ids = self.encode(prompt)
            problem = self.check_request(ids, params)
            if problem:
                raise ValueError(problem)
        except ValueError as exc:
            req = self.scheduler.add_request([], params)
            req.error = str(exc)
            return req
        req = self.scheduler.add_request(ids, params)
        if self.tokenizer is not None and not req.finished:
            self._detok[req.request_id] = _Detokenizer(self.tokenizer, req.params.stop)
        return req

    def abort(self, request: Request, reason: str = "aborted") -> None:
        """End a request (waiting or running) and free its pages."""
        self.scheduler.abort(request, reason)
        self._detok.pop(request.request_id, None)

    def step(self):
        """One forward of the running batch, or several decode forwards (multi-step decode); the scheduler's
        step outputs in order, with their new text. A request whose text reaches a stop string ends with the token
        that completed it: its later outputs of the same step are dropped."""
        # grad mode switched by hand: torch.no_grad()'s context manager is a dozen Python and C calls, each slow
        # after a step's weights have pushed the interpreter out of the caches (docs/performance.md)
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            outputs = self.scheduler.step()
        finally:
            if grad:
                torch._C._set_grad_enabled(True)
        if not self._detok:
            return outputs
        kept, stopped = [], set()
        for out in outputs:
            req = out.request
            if req.request_id in stopped:
                continue
            kept.append(out)
            detok = self._detok.get(req.request_id)
            if detok is None or out.new_token_id is None:
                continue
            n = out.num_output_tokens
            tokens = req.output_token_ids if n == len(req.output_token_ids) else req.output_token_ids[:n]
            out.text, stop = detok.update(tokens, out.finished, check_stop=n >= req.params.min_tokens)
            req.output_text = detok.text
            if stop and not out.finished:
                del req.output_token_ids[n:]  # decoded past the stop string within this step
                if req.finished:  # by length or EOS on a later token of this step: the stop string came first
                    req.finish_reason = "stop"
                else:
                    self.scheduler.abort(req, "stop")
                out.finished = True
                stopped.add(req.request_id)
            if out.finished:
                del self._detok[req.request_id]
        return kept

    def reset(self) -> list[Request]:
        """Abort every unfinished request (after a failed forward: the batch's state is unknown)."""
        reqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        for req in reqs:
            self.abort(req, "error")
        self.scheduler._rejected.clear()
        return reqs

    # -- generation --------------------------------------------------------------------------------
    def generate_stream(self, prompts: Prompt | Sequence[Prompt], params=None) -> Iterator[tuple[int, int, str]]:
        """Yield ``(prompt index, new token id, text delta)`` as tokens are generated (text delta is ""
        without a tokenizer). Rejected prompts yield nothing."""
        yield from self._run(prompts, params, outputs=None)

    def generate(self, prompts: Prompt | Sequence[Prompt], params=None) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); one :class:`RequestOutput` per prompt, in order.
        A prompt that cannot be served gets ``finish_reason="rejected"`` and ``.error``; the others run."""
        outputs: list[RequestOutput] = []
        for _ in self._run(prompts, params, outputs):
            pass
        return outputs

    def _run(self, prompts, params, outputs: list | None):
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int)
        )
        prompts = [prompts] if single else list(prompts)
        params = self._params_list(prompts, params)
        if self.scheduler.has_unfinished():
            raise RuntimeError("the engine is already serving requests (generate is not reentrant)")
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        index = {r.request_id: i for i, r in enumerate(reqs)}
        try:
            while self.scheduler.has_unfinished():
                for out in self.step():
                    if out.new_token_id is None:
                        continue
                    yield index[out.request.request_id], out.new_token_id, out.text
        finally:  # an abandoned stream frees its requests' pages
            for r in reqs:
                if not r.finished:
                    self.abort(r)
        if outputs is not None:
            for p, r in zip(prompts, reqs):
                text = None
                if self.tokenizer is not None and r.finish_reason != "rejected":
                    text = r.output_text
                outputs.append(RequestOutput(
                    r.request_id, p if isinstance(p, str) else None, list(r.prompt_token_ids),
                    [CompletionOutput(0, list(r.output_token_ids), text, r.finish_reason,
                                      list(r.logprobs) if r.params.logprobs is not None else None)], True, r.error,
                ))

"""The engine: serves a cached graph (the pipeline's output after ``cache_init``) with continuous batching
(:mod:`autodeploy.runtime.scheduler`) and per-request sampling (:mod:`autodeploy.runtime.sampler`).

:class:`Engine` rejects a request it cannot serve (``finish_reason="rejected"``, ``error``) and serves the
rest; :meth:`Engine.check` raises ``ValueError`` naming the first such request and its limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.fx import GraphModule

from ..errors import AutoDeployError
from ..utils.fx import named_graphmodules
from .kv_cache import KV_CACHE_META_KEY, KVCacheSpec
from .sampler import SamplingParams
from .scheduler import Request, Scheduler
from .sequence_info import LOGITS_IDX, SequenceInfo, SequenceRequest, last_token_idx

Prompt = str | Sequence[int]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None


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
        "the model has no KV cache: the runtime needs the cache_init stage (insert_cached_attention), which "
        "only applies to auto_deploy::torch_attention nodes; check that the pattern_matcher stage matched the "
        "model's attention (see its log / AD_DUMP_GRAPHS_DIR dumps)"
    )


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
    """Incremental text of one request: each call returns the new text since the previous one."""

    def __init__(self, tokenizer):
        self.tokenizer, self.text = tokenizer, ""

    def update(self, token_ids: list[int], final: bool) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:  # an incomplete UTF-8 sequence: wait for more tokens
            return ""
        if not text.startswith(self.text):  # a merge changed earlier text: emit nothing, keep the full text
            self.text = text
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


class Engine:
    """Serves a cached graph (the pipeline's output after ``cache_init``): continuous batching and sampling.

    ``model``: a module whose (sub)graph has ``meta['kv_cache']`` with allocated caches;
    ``tokenizer``: optional (HF tokenizer), for string prompts and output text;
    ``eos_token_ids``: tokens that end generation unless ``ignore_eos``;
    ``max_num_tokens``: tokens per forward (chunked prefill); default ``max_batch_size * max_seq_len``;
    ``vocab_size``: prompt token ids are checked against it (default: the embedding table's rows).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] | int | None = None,
        max_num_tokens: int | None = None,
        vocab_size: int | None = None,
    ):
        gm, spec = find_cached_graph(model)
        if spec.num_pages < 1:
            raise AutoDeployError("the KV cache is not allocated: run initialize_cache / resize_kv_cache first")
        if max_num_tokens is not None and max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
        self.model, self.spec, self.tokenizer = model, spec, tokenizer
        self.device = torch.device(spec.device)
        self.gathers = LOGITS_IDX in [n.name for n in gm.graph.find_nodes(op="placeholder")]
        self.info = SequenceInfo(spec.max_batch_size, spec.max_seq_len, spec.page_size, spec.num_pages,
                                 max_num_tokens=max_num_tokens)
        if eos_token_ids is None and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos_token_ids = tokenizer.eos_token_id
        self.scheduler = Scheduler(self.info, self._forward, eos_token_ids,
                                   vocab_size if vocab_size is not None else _embedding_vocab(gm))

    @property
    def max_seq_len(self) -> int:
        return self.info.max_seq_len

    # -- the model ---------------------------------------------------------------------------------
    def _forward(self, seqs: list[SequenceRequest]) -> torch.Tensor:
        batch = self.info.build(seqs, gather="last" if self.gathers else None, device=self.device)
        with torch.no_grad():
            out = self.model(*batch.as_args(include_logits_idx=self.gathers))
        logits = (out[0] if isinstance(out, (tuple, list)) else out)[0]
        if not self.gathers:
            logits = logits[last_token_idx(batch.seq_lens).to(logits.device)]
        return logits.float()

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
                problem = self.scheduler.check_request(self.encode(prompt), p)
            except ValueError as exc:
                problem = str(exc)
            if problem:
                raise ValueError(f"prompt {i}: {problem}")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> Request:
        """Queue one request (rejected at once when it cannot be served, see :class:`Scheduler`)."""
        try:
            ids = self.encode(prompt)
        except ValueError as exc:
            req = self.scheduler.add_request([], params)
            req.error = str(exc)
            return req
        return self.scheduler.add_request(ids, params)

    def step(self):
        """One forward of the running batch; the scheduler's step outputs."""
        return self.scheduler.step()

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
        detok = [_Detokenizer(self.tokenizer) for _ in reqs]
        try:
            while self.scheduler.has_unfinished():
                for out in self.step():
                    if out.new_token_id is None:
                        continue
                    i = index[out.request.request_id]
                    delta = detok[i].update(out.request.output_token_ids, out.finished)
                    yield i, out.new_token_id, delta
        finally:  # an abandoned stream frees its requests' pages
            for r in reqs:
                if not r.finished:
                    self.scheduler.abort(r)
        if outputs is not None:
            for p, r, _ in zip(prompts, reqs, detok):
                text = None
                if self.tokenizer is not None and r.finish_reason != "rejected":
                    text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
                outputs.append(RequestOutput(
                    r.request_id, p if isinstance(p, str) else None, list(r.prompt_token_ids),
                    [CompletionOutput(0, list(r.output_token_ids), text, r.finish_reason)], True, r.error,
                ))

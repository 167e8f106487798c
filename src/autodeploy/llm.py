"""Text generation: :class:`LLM` / :class:`SamplingParams` (the familiar LLM-API shape) over :class:`Engine`.

    llm = autodeploy.LLM(model="path/to/checkpoint", max_batch_size=8, max_seq_len=512,
                         kv_cache_config={"max_tokens": 4096})
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids
    for index, token_id, text_delta in llm.generate_stream(prompts, params): ...

:class:`LLM` builds the pipeline (default YAML <- ``yaml_extra`` <- arguments <- ``overrides``) and
runs it through ``cache_init``, then serves the cached graph with :class:`Engine`: continuous batching
(:mod:`autodeploy.runtime.scheduler`) and per-request sampling (:mod:`autodeploy.runtime.sampler`).
``LLM.generate`` checks every request first and raises ``ValueError`` naming the limit; the
:class:`Engine` itself rejects a bad request (``finish_reason="rejected"``, ``error``) and serves the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.fx import GraphModule

from .errors import AutoDeployError
from .runtime.kv_cache import KV_CACHE_META_KEY, KVCacheSpec
from .runtime.sampler import SamplingParams
from .runtime.scheduler import Request, Scheduler
from .runtime.sequence_info import LOGITS_IDX, SequenceInfo, SequenceRequest, last_token_idx
from .utils.fx import named_graphmodules

__all__ = ["LLM", "SamplingParams", "Engine", "RequestOutput", "CompletionOutput"]

Prompt = str | Sequence[int]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# the cache_init entries the runtime needs (set on top of the YAML: a no-op when it has them)
_CACHE_INIT_KEYS = ("insert_cached_attention", "initialize_cache", "resize_kv_cache")
_KV_CACHE_CONFIG_KEYS = {
    "max_tokens": "transforms.resize_kv_cache.max_tokens",
    "free_memory_fraction": "transforms.resize_kv_cache.free_memory_fraction",
    "page_size": "transforms.insert_cached_attention.page_size",
    "backend": "transforms.insert_cached_attention.backend",
}


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
            for p, r, d in zip(prompts, reqs, detok):
                text = None
                if self.tokenizer is not None and r.finish_reason != "rejected":
                    text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
                outputs.append(RequestOutput(
                    r.request_id, p if isinstance(p, str) else None, list(r.prompt_token_ids),
                    [CompletionOutput(0, list(r.output_token_ids), text, r.finish_reason)], True, r.error,
                ))


def has_tokenizer_files(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def _load_tokenizer(path: Path):
    if not has_tokenizer_files(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_token_ids(path: Path, factory, tokenizer) -> list[int] | None:
    eos = None
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None and factory is not None:
        config = factory.get_config()
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        eos = getattr(config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return None
    return [eos] if isinstance(eos, int) else list(eos)


def llm_config(
    model: str | Path,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    kv_cache_config: Mapping[str, Any] | None = None,
    yaml_extra: Iterable[str | Path] | str | Path | None = None,
    dtype: str | None = None,
    device: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    **more_overrides: Any,
):
    """The pipeline configuration :class:`LLM` runs: default YAML <- ``yaml_extra`` <- the arguments (as
    dotted keys, see :class:`LLM`) <- ``overrides``. The cache_init entries are ensured."""
    from .config import load_config

    settings: dict[str, Any] = {}
    for key, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                       ("dtype", dtype), ("device", device)):
        if value is not None:
            settings[key] = value
    for key in _CACHE_INIT_KEYS:  # the runtime needs cache_init; a no-op where the YAML has these
        settings[f"transforms.{key}.stage"] = "cache_init"
    unknown = set(kv_cache_config or {}) - set(_KV_CACHE_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown kv_cache_config key(s) {sorted(unknown)}; known: {sorted(_KV_CACHE_CONFIG_KEYS)}")
    for key, value in (kv_cache_config or {}).items():
        settings[_KV_CACHE_CONFIG_KEYS[key]] = value
    settings.update(overrides or {})
    settings.update(more_overrides)
    if isinstance(yaml_extra, (str, Path)):
        yaml_extra = [yaml_extra]
    return load_config(yaml_extra=yaml_extra, overrides=settings, base={"model": str(model)})


class LLM:
    """Build the pipeline for ``model`` and serve it.

    ``model``: a checkpoint folder (config.json + *.safetensors), or an already-optimized module with a
    KV cache (e.g. ``autodeploy.optimize(path)``'s output). Pipeline arguments map to config keys:
    ``max_batch_size``, ``max_seq_len``, ``dtype``, ``device``; ``kv_cache_config`` keys
    ``max_tokens`` / ``free_memory_fraction`` -> ``transforms.resize_kv_cache.*``, ``page_size`` /
    ``backend`` -> ``transforms.insert_cached_attention.*``; ``yaml_extra``: extra YAML files;
    ``overrides`` (a ``{"dotted.key": value}`` mapping) and ``**more_overrides`` (keyword form, e.g.
    ``model_kwargs={...}`` or ``**{"transforms.x.y": 1}``) are applied last. ``max_num_tokens`` (tokens per
    forward, chunked prefill) is a runtime setting;
    ``tokenizer``: a tokenizer or its folder (default: the checkpoint's, when it has tokenizer files);
    ``eos_token_ids``: default: the checkpoint's generation_config / config / tokenizer EOS.
    """

    def __init__(
        self,
        model: str | Path | nn.Module,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        max_num_tokens: int | None = None,
        kv_cache_config: Mapping[str, Any] | None = None,
        yaml_extra: Iterable[str | Path] | str | Path | None = None,
        tokenizer: Any = None,
        dtype: str | None = None,
        device: str | None = None,
        eos_token_ids: Sequence[int] | int | None = None,
        overrides: Mapping[str, Any] | None = None,
        **more_overrides: Any,
    ):
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if isinstance(model, nn.Module):
            pipeline_args = dict(max_batch_size=max_batch_size, max_seq_len=max_seq_len, kv_cache_config=kv_cache_config,
                                 yaml_extra=yaml_extra, dtype=dtype, device=device, overrides=overrides)
            given = [k for k, v in pipeline_args.items() if v is not None] + list(more_overrides)
            if given:
                raise ValueError(f"{', '.join(given)}: pipeline settings apply to a checkpoint path, not to an "
                                 "already-optimized module")
            self.config = None
            self.engine = Engine(model, tokenizer, eos_token_ids, max_num_tokens=max_num_tokens)
            return
        from .api import build_optimizer

        path = Path(model)
        self.config = llm_config(model, max_batch_size, max_seq_len, kv_cache_config, yaml_extra, dtype, device,
                                 overrides, **more_overrides)
        optimizer, factory = build_optimizer(self.config)
        module = optimizer()
        if tokenizer is None and path.is_dir():
            tokenizer = _load_tokenizer(path)
        eos = eos_token_ids
        if eos is None and path.is_dir():
            eos = _eos_token_ids(path, factory, tokenizer)
        vocab = None
        if factory is not None:
            config = factory.get_config()
            config = config.get_text_config() if hasattr(config, "get_text_config") else config
            vocab = getattr(config, "vocab_size", None)
        self.engine = Engine(module, tokenizer, eos, max_num_tokens=max_num_tokens, vocab_size=vocab)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def module(self) -> nn.Module:
        return self.engine.model

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params=None) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt (strings or token-id lists). Raises ``ValueError`` (naming
        the prompt and the limit) before generating anything if a request cannot be served."""
        prompts_list = self._as_list(prompts)
        self.engine.check(prompts_list, sampling_params)
        return self.engine.generate(prompts_list, sampling_params)

    def generate_stream(
        self, prompts: Prompt | Sequence[Prompt], sampling_params=None
    ) -> Iterator[tuple[int, int, str]]:
        """Yield ``(prompt index, new token id, text delta)`` as tokens come; checks like :meth:`generate`."""
        prompts_list = self._as_list(prompts)
        self.engine.check(prompts_list, sampling_params)
        return self.engine.generate_stream(prompts_list, sampling_params)

    @staticmethod
    def _as_list(prompts) -> list[Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

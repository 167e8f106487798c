"""Text generation: :class:`LLM` / :class:`SamplingParams` (the familiar LLM-API shape) over :class:`Engine`.

    llm = autodeploy.LLM(model="path/to/checkpoint", max_batch_size=8, max_seq_len=512,
                         kv_cache_config={"max_tokens": 4096})
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids
    for index, token_id, text_delta in llm.generate_stream(prompts, params): ...

:class:`LLM` builds the pipeline (default YAML <- ``yaml_extra`` <- arguments <- ``overrides``) and
runs it through ``cache_init``, then serves the cached graph with the runtime's
:class:`~autodeploy.runtime.engine.Engine`: continuous batching and per-request sampling.
``LLM.generate`` checks every request first and raises ``ValueError`` naming the limit; the
:class:`Engine` itself rejects a bad request (``finish_reason="rejected"``, ``error``) and serves the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from torch import nn

from .runtime.engine import CompletionOutput, Engine, Prompt, RequestOutput, decode_steps_from_env
from .runtime.sampler import SamplingParams
from .utils.fx import text_config
from .utils.logger import ad_logger

__all__ = ["LLM", "SamplingParams", "Engine", "RequestOutput", "CompletionOutput"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# the cache_init entries the runtime needs (set on top of the YAML: a no-op when it has them)
_CACHE_INIT_KEYS = ("insert_cached_attention", "insert_cached_ssm", "initialize_cache", "resize_kv_cache")
_KV_CACHE_CONFIG_KEYS = {
    "max_tokens": "transforms.resize_kv_cache.max_tokens",
    "free_memory_fraction": "transforms.resize_kv_cache.free_memory_fraction",
    "page_size": "transforms.insert_cached_attention.page_size",
    "backend": "transforms.insert_cached_attention.backend",
}


def serves_package(config) -> bool:
    """Whether :class:`LLM` builds ``config`` in a child process and serves its package: the ``aoti``
    backend (what ``auto`` picks where AOTInductor's code is validated), one process, on the CPU."""
    import torch

    from .compile.backends import resolve_compile_backend

    compile_config = config.transforms.get("compile_model") or {}
    if config.world_size != 1 or torch.device(config.device).type != "cpu" or not compile_config.get("enabled", True):
        return False
    return resolve_compile_backend(compile_config.get("backend", "auto")) == "aoti"


def has_tokenizer_files(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def _load_tokenizer(path: Path):
    if not has_tokenizer_files(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_token_ids(path: Path, factory, tokenizer) -> list[int] | None:
    from .models.hf import checkpoint_eos_token_ids

    eos = checkpoint_eos_token_ids(path, factory)
    if eos is None and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    return eos


def llm_config(
    model: str | Path,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    kv_cache_config: Mapping[str, Any] | None = None,
    yaml_extra: Iterable[str | Path] | str | Path | None = None,
    dtype: str | None = None,
    device: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    **more_overrides: Any,
):
    """The pipeline configuration :class:`LLM` runs: default YAML <- ``yaml_extra`` <- the arguments (as
    dotted keys, see :class:`LLM`) <- ``overrides``. The cache_init entries are ensured."""
    from .config import load_config

    settings: dict[str, Any] = {}
    for key, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                       ("dtype", dtype), ("device", device), ("world_size", world_size)):
        if value is not None:
            settings[key] = value
    for key in _CACHE_INIT_KEYS:  # the runtime needs cache_init; a no-op where the YAML has these
        settings[f"transforms.{key}.stage"] = "cache_init"
    unknown = set(kv_cache_config or {}) - set(_KV_CACHE_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown kv_cache_config key(s) {sorted(unknown)}; known: {sorted(_KV_CACHE_CONFIG_KEYS)}")
    for key, value in (kv_cache_config or {}).items():
        settings[_KV_CACHE_CONFIG_KEYS[key]] = value
        if key == "page_size":  # the pages of a graph without attention too (insert_cached_ssm makes them)
            settings["transforms.insert_cached_ssm.page_size"] = value
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
    ``backend`` -> ``transforms.insert_cached_attention.*`` (``page_size`` also to ``insert_cached_ssm``, which
    makes the pages of a graph without attention); ``yaml_extra``: extra YAML files;
    ``overrides`` (a ``{"dotted.key": value}`` mapping) and ``**more_overrides`` (keyword form, e.g.
    ``model_kwargs={...}`` or ``**{"transforms.x.y": 1}``) are applied last. ``max_num_tokens`` (tokens per
    forward, chunked prefill) is a runtime setting;
    ``tokenizer``: a tokenizer or its folder (default: the checkpoint's, when it has tokenizer files);
    ``eos_token_ids``: default: the checkpoint's generation_config / config / tokenizer EOS.
    ``world_size``: ranks to split the model across (config key ``world_size``): without a launcher the
    other ranks are started here as processes and this one drives them; under ``torchrun`` every rank
    constructs the LLM, and on ranks other than 0 the constructor serves rank 0's steps until rank 0 calls
    :meth:`close` (or exits), then returns an LLM that cannot generate (``is_driver`` False).
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
        world_size: int | None = None,
        **more_overrides: Any,
    ):
        decode_steps_from_env()  # a bad AUTODEPLOY_DECODE_STEPS is reported before the build, not after it
        self._built = None
        self.rank_peak_rss_bytes: dict[int, int] = {}  # after close(): each rank's peak RSS
        self.build_peak_rss_bytes: int | None = None  # the build process's, where one built the model
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if isinstance(model, nn.Module):
            pipeline_args = dict(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                 kv_cache_config=kv_cache_config, yaml_extra=yaml_extra, dtype=dtype, device=device,
                                 overrides=overrides, world_size=world_size)
            given = [k for k, v in pipeline_args.items() if v is not None] + list(more_overrides)
            if given:
                raise ValueError(f"{', '.join(given)}: pipeline settings apply to a checkpoint path, not to an "
                                 "already-optimized module")
            self.config = None
            self.engine = Engine(model, tokenizer, eos_token_ids, max_num_tokens=max_num_tokens)
            return
        path = Path(model)
        self.config = llm_config(model, max_batch_size, max_seq_len, kv_cache_config, yaml_extra, dtype, device,
                                 overrides, world_size, **more_overrides)
        if serves_package(self.config) and self._serve_package(path, tokenizer, eos_token_ids, max_num_tokens):
            return
        from .distributed.runner import build_model

        self._built = build_model(self.config)
        module, factory = self._built.module, self._built.factory
        if module is None:  # a rank other than 0: its steps are served
            self.engine = None
            return
        if tokenizer is None and path.is_dir():
            tokenizer = _load_tokenizer(path)
        eos = eos_token_ids
        if eos is None and path.is_dir():
            eos = _eos_token_ids(path, factory, tokenizer)
        vocab = None
        if factory is not None:
            vocab = getattr(text_config(factory.get_config()), "vocab_size", None)
        self.engine = Engine(module, tokenizer, eos, max_num_tokens=max_num_tokens, vocab_size=vocab)

    def _serve_package(self, path: Path, tokenizer, eos_token_ids, max_num_tokens) -> bool:
        """Build in a child process and serve its package (:mod:`autodeploy.build_process`); False where the
        graph could not be packaged, after switching the config to ``torch-compile`` for an in-process build."""
        from .build_process import PACKAGE_CACHE_ENV, build_package, cached_package, package_cache_key, remove_package
        from .errors import AutoDeployError
        from .runtime.package import load_package

        key = package_cache_key(self.config)
        package = cached_package(key) if key is not None else None
        if package is not None:
            try:
                module = load_package(package)
                ad_logger.info(f"serving the package built earlier for this checkpoint and configuration ({package}; "
                               f"{PACKAGE_CACHE_ENV}=0 rebuilds)")
            except AutoDeployError as exc:  # e.g. its compiled decode step was removed from the cache
                ad_logger.warning(f"the cached package {package} cannot be served ({exc}); building again")
                package = None
        if package is None:
            package, result = build_package(self.config, key)
            if package is None:
                ad_logger.warning(f"serving from this process with torch-compile instead: {result['reason']}")
                self.config.transforms.setdefault("compile_model", {})["backend"] = "torch-compile"
                return False
            try:
                module = load_package(package)
            finally:
                remove_package(package)  # a staged one: the weights stay mapped, the file goes with the model
            self.build_peak_rss_bytes = result["peak_rss_bytes"]
        if tokenizer is None and path.is_dir():
            tokenizer = _load_tokenizer(path)
        eos = eos_token_ids if eos_token_ids is not None else module.eos_token_ids
        if eos is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = [tokenizer.eos_token_id]
        self.engine = Engine(module, tokenizer, eos, max_num_tokens=max_num_tokens, vocab_size=module.vocab_size)
        return True

    @property
    def is_driver(self) -> bool:
        """Whether this process generates (rank 0 of a distributed run, or the only process)."""
        return self.engine is not None

    def close(self) -> None:
        """End a distributed run: the other ranks stop, spawned ones exit, the process group is left. Safe to
        call twice; a single-process LLM has nothing to close."""
        if self._built is not None:
            self.rank_peak_rss_bytes = self._built.close()
            self._built = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self._driver().tokenizer

    def _driver(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("this rank serves rank 0's steps: only rank 0 of a distributed run generates")
        return self.engine

    @property
    def module(self) -> nn.Module:
        return self.engine.model

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params=None) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt (strings or token-id lists). Raises ``ValueError`` (naming
        the prompt and the limit) before generating anything if a request cannot be served."""
        prompts_list = self._as_list(prompts)
        self._driver().check(prompts_list, sampling_params)
        return self.engine.generate(prompts_list, sampling_params)

    def generate_stream(
        self, prompts: Prompt | Sequence[Prompt], sampling_params=None
    ) -> Iterator[tuple[int, int, str]]:
        """Yield ``(prompt index, new token id, text delta)`` as tokens come; checks like :meth:`generate`."""
        prompts_list = self._as_list(prompts)
        self._driver().check(prompts_list, sampling_params)
        return self.engine.generate_stream(prompts_list, sampling_params)

    @staticmethod
    def _as_list(prompts) -> list[Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

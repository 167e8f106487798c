"""The inference optimizer: validates the transforms mapping and runs it in stage order."""

from __future__ import annotations

import difflib
import sys
import time
from typing import Any

import yaml
from pydantic import ValidationError
from torch import nn

from ..config.loader import AutoDeployConfig, describe_transform_validation_error
from ..errors import ConfigError
from ..utils.graph_writer import graph_writer
from ..utils.logger import ad_logger, transform_logging
from ..utils.memory import release_trace_caches
from .interface import BaseTransform, PipelineContext, Stages, TransformRegistry


def _parse_stage(value: Any, where: str) -> Stages:
    if isinstance(value, Stages):
        return value
    try:
        return Stages(value)
    except ValueError:
        allowed = ", ".join(s.value for s in Stages)
        raise ConfigError(f"{where}: unknown stage {value!r}; expected one of: {allowed}") from None


def _rank_of(world_size: int) -> int:
    """This process's rank in a run of ``world_size`` ranks (whose process group must exist)."""
    import torch.distributed as dist

    if world_size == 1:
        return 0
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        raise ConfigError(f"world_size={world_size} needs {world_size} processes in one group: use "
                          f"LLM(world_size={world_size}), --world-size {world_size}, or torchrun")
    return dist.get_rank()


class InferenceOptimizer:
    """Runs the configured transforms on a module, sorted stably by stage (config order within one)."""

    def __init__(self, config: AutoDeployConfig, factory: Any = None, verify: Any = None):
        """``verify``: a :class:`autodeploy.verify.VerifyOptions` to check every transform's graph against HF
        transformers (``--verify``), or None."""
        self.config = config
        self.ctx = PipelineContext(
            factory=factory,
            max_batch_size=config.max_batch_size,
            max_seq_len=config.max_seq_len,
            device=config.device,
            world_size=config.world_size,
            rank=_rank_of(config.world_size),
        )
        self.transforms = self._build_transforms(config)
        self.verifier = None
        if verify is not None:
            from ..verify import Verifier

            self.verifier = Verifier(factory, config.max_batch_size, config.max_seq_len, config.device, verify)

    @staticmethod
    def _build_transforms(config: AutoDeployConfig) -> list[BaseTransform]:
        built: list[tuple[int, BaseTransform]] = []
        for position, (key, entry) in enumerate(config.transforms.items()):
            where = f"transforms.{key} (from {config.source_of(f'transforms.{key}')})"
            if not TransformRegistry.has(key):
                close = difflib.get_close_matches(key, TransformRegistry.keys(), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown transform key {key!r} in {config.source_of(f'transforms.{key}')}{hint}")
            if "stage" not in entry:
                raise ConfigError(f"{where}: missing required field 'stage'")
            entry = {**entry, "stage": _parse_stage(
                entry["stage"], f"transforms.{key}.stage (from {config.source_of(f'transforms.{key}.stage')})"
            )}
            transform_cls = TransformRegistry.get(key)
            config_cls = transform_cls.get_config_class()
            try:
                t_config = config_cls.model_validate(entry)
            except ValidationError as exc:
                raise ConfigError(
                    describe_transform_validation_error(key, exc, config, config_cls.model_fields)
                ) from None
            for extra in (t_config.model_extra or {}):
                close = difflib.get_close_matches(extra, list(config_cls.model_fields), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                ad_logger.warning(f"transforms.{key}.{extra} is not a field of {config_cls.__name__}; ignored{hint}")
            built.append((position, transform_cls(t_config)))
        built.sort(key=lambda item: (item[1].config.stage, item[0]))
        return [t for _, t in built]

    def __call__(self, mod: nn.Module | None = None, until: Stages | str | None = None) -> nn.Module:
        """Run every transform whose stage is at most ``until`` (all when None)."""
        until_stage = _parse_stage(until, "until") if until is not None else None
        target = graph_writer.target_dir()
        if target is not None:  # fail before any work if the dump directory cannot be used
            graph_writer.check_dir_usable(target)
            graph_writer.record_config(yaml.safe_dump(self.config.model_dump(), sort_keys=False))
        mod = mod if mod is not None else nn.Module()
        start = time.perf_counter()
        matching = False  # inside the pattern_matcher stage
        selected = [t for t in self.transforms if until_stage is None or t.config.stage <= until_stage]
        show_progress = sys.stderr.isatty()  # a person is watching: say what runs before it runs
        for transform in selected:
            if transform.config.enabled:
                transform.prepare(self.ctx)
        released_before = {Stages.WEIGHT_LOAD, Stages.COMPILE}  # the stages where resident memory grows
        for position, transform in enumerate(selected, start=1):
            if matching and transform.config.stage > Stages.PATTERN_MATCHER:
                self._log_coverage(mod)
                matching = False
            reached = {s for s in released_before if transform.config.stage >= s}
            if reached:
                release_trace_caches(mod)
                released_before -= reached
            if show_progress and transform.config.enabled:
                with transform_logging(transform.config.stage.value, transform.get_transform_key()):
                    ad_logger.info(f"running ({position}/{len(selected)}) ...")
            mod = transform(mod, self.ctx)
            if self.verifier is not None:
                self._verify(mod, transform, position)
            matching |= transform.config.stage == Stages.PATTERN_MATCHER
        if matching:
            self._log_coverage(mod)
        ad_logger.info(f"pipeline finished in {time.perf_counter() - start:.2f} s")
        if self.verifier is not None:
            ad_logger.info(self.verifier.table())
        return mod

    def _verify(self, mod: nn.Module, transform: BaseTransform, position: int) -> None:
        """Check the graph after ``transform``; the first failure ends the pipeline (with the table so far)."""
        with transform_logging(transform.config.stage.value, transform.get_transform_key()):
            row = self.verifier.check(mod, transform, position)
        if row is not None and not row.passed:
            ad_logger.error(self.verifier.table())
            raise self.verifier.error(row)

    def _log_coverage(self, mod: nn.Module) -> None:
        """One line: how many attention / RoPE / norm / MoE blocks became canonical ops."""
        from ..utils.coverage import measure_coverage, rope_layer_count

        config = self.ctx.text_config()
        coverage = measure_coverage(mod, getattr(config, "num_hidden_layers", None), rope_layer_count(config))
        graph_writer.record_coverage(coverage.line())
        (ad_logger.info if coverage.complete else ad_logger.warning)(
            coverage.line() + ("" if coverage.complete else "  <- partly matched: see the pattern_matcher dumps")
        )

"""The transform interface: stages, per-transform config, the base class and the registry.

A transform is a class registered under a key (``@TransformRegistry.register("export_to_gm")``)
whose ``config:`` annotation names its pydantic config class (``get_config_class()`` reads it). Calling it
on a module runs, in order: pre-cleanup, the transform itself (per GraphModule or on the whole model),
post-cleanup, memory check, visualization, graph dump and a ``[SUMMARY]`` log line. Its
:class:`TransformInfo` is kept as history on the module.

The invariants between transforms, kept by one mechanism: a graph is *clean* (no dead code, linted, code
regenerated) and has *current shapes* (every ``node.meta["val"]`` propagated) when the last transform's
info says so. A transform reports honestly what holds after it (:meth:`TransformInfo.changed` after a
rewrite, :meth:`TransformInfo.unchanged` when it changed nothing), and the driver trusts the report; it
restores what the next transform needs: before a transform, it cleans the graph if ``requires_clean_graph``
and propagates shapes if ``requires_shape_prop``; after it, it cleans if ``run_graph_cleanup`` and
propagates if ``run_shape_prop``, each only where the info says the invariant does not hold. Transforms
that read shapes and rewrite graphs use :class:`GraphRewriteConfig` (shapes required before, propagated
after, so graph dumps show them).
"""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass, field
from enum import Enum
from functools import total_ordering
from typing import Any, Callable, ClassVar, Type

from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.fx import GraphModule

from ..errors import AutoDeployError, ConfigError, TransformError
from ..utils import fx as fx_utils
from ..utils.graph_writer import graph_writer
from ..utils.logger import ad_logger, transform_logging
from ..utils.memory import current_memory_bytes, format_bytes


@total_ordering
class Stages(Enum):
    """Enumerated (ordered!) stages of the transformation pipeline.

    This is used to classify and pre-order transforms.
    """

    FACTORY = "factory"
    EXPORT = "export"
    POST_EXPORT = "post_export"
    PATTERN_MATCHER = "pattern_matcher"
    SHARDING = "sharding"
    WEIGHT_LOAD = "weight_load"
    POST_LOAD_FUSION = "post_load_fusion"
    CACHE_INIT = "cache_init"
    VISUALIZE = "visualize"
    COMPILE = "compile"

    def _order(self) -> int:
        return list(type(self)).index(self)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Stages):
            return NotImplemented
        return self._order() < other._order()


class TransformConfig(BaseModel):
    """Configuration shared by every transform; transforms subclass it for their own fields."""

    model_config = ConfigDict(extra="allow", use_enum_values=False, validate_assignment=True)

    stage: Stages = Field(
        description="The stage of the transformation pipeline where this transform should run."
    )
    run_per_gm: bool = Field(
        default=True, description="Whether to run the transform per graph (sub)module or on whole module."
    )
    enabled: bool = Field(default=True, description="Whether to enable this transform.")
    skip_on_error: bool = Field(default=False, description="Whether to skip the transform if an error occurs.")
    run_graph_cleanup: bool = Field(
        default=True, description="Whether to run graph cleanup/canonicalization after this transform."
    )
    run_shape_prop: bool = Field(default=False, description="Whether to run shape propagation after this transform.")
    requires_clean_graph: bool = Field(
        default=True, description="Whether this transform requires the graph to be clean before it is applied."
    )
    requires_shape_prop: bool = Field(
        default=False, description="Whether this transform requires shape propagation before it is applied."
    )
    debug_visualize_dir: str | None = Field(
        default=None,
        description="Debug visualization directory. None to disable visualization, or a path string to "
        "specify the output directory.",
    )
    expect_mem_change: bool = Field(
        default=False, description="Whether this transform is expected to cause changes in CUDA memory stats."
    )


class GraphRewriteConfig(TransformConfig):
    """The config of a transform that reads ``node.meta["val"]`` and rewrites the graph: shapes current
    before it, re-propagated after it changed anything (so the next transform and the graph dump see them)."""

    requires_shape_prop: bool = Field(
        default=True, description=TransformConfig.model_fields["requires_shape_prop"].description)
    run_shape_prop: bool = Field(default=True, description=TransformConfig.model_fields["run_shape_prop"].description)


class TransformInfo(BaseModel):
    """What one transform did: the record kept in the module's transform history."""

    model_config = ConfigDict(frozen=True)

    skipped: bool = Field(default=True, description="Whether the transform was skipped.")
    num_matches: int = Field(default=0, description="Number of matches (rewrites) the transform made.")
    is_clean: bool = Field(default=False, description="Whether the graph is clean after the transform.")
    has_valid_shapes: bool = Field(default=False, description="Whether node.meta shapes are current after it.")

    @classmethod
    def changed(cls, num_matches: int, shapes_current: bool = False) -> "TransformInfo":
        """The info after ``num_matches`` rewrites: with any, the graph needs clean-up and, unless
        ``shapes_current``, shape propagation; with none, the invariants are as before."""
        if num_matches == 0:
            return cls.unchanged(skipped=False)
        return cls(skipped=False, num_matches=num_matches, is_clean=False, has_valid_shapes=shapes_current)

    @classmethod
    def unchanged(cls, skipped: bool = True) -> "TransformInfo":
        """The info of a transform that left the graph as it was: clean, with the shapes it was given (every
        transform that changes a graph and leaves shapes stale is in ``cache_init``, after which nothing
        reads them)."""
        return cls(skipped=skipped, num_matches=0, is_clean=True, has_valid_shapes=True)

    def __or__(self, other: "TransformInfo") -> "TransformInfo":
        """Combine the infos of one transform applied to several GraphModules."""
        return TransformInfo(
            skipped=self.skipped and other.skipped,
            num_matches=self.num_matches + other.num_matches,
            is_clean=self.is_clean and other.is_clean,
            has_valid_shapes=self.has_valid_shapes and other.has_valid_shapes,
        )


@dataclass
class TransformRecord:
    """One entry of the transform history kept on the module."""

    key: str
    stage: Stages
    info: TransformInfo
    time_s: float = 0.0
    disabled: bool = False
    mem_delta_bytes: int = 0


HISTORY_ATTR = "_autodeploy_history"

# A transform not expected to change memory that moves RSS by more than this gets a warning.
_MEM_WARN_BYTES = 64 * 1024**2


def transform_history(mod: nn.Module) -> dict[str, TransformRecord]:
    """The ordered history of transforms applied to ``mod`` (key -> record)."""
    return getattr(mod, HISTORY_ATTR, {})


@dataclass
class PipelineContext:
    """What transforms share besides the module: the model factory and pipeline-wide settings."""

    factory: Any = None
    max_batch_size: int = 8
    max_seq_len: int = 512
    device: str = "cpu"
    world_size: int = 1  # ranks the graph is split for (the sharding stage)
    rank: int = 0  # this process's rank
    extras: dict[str, Any] = field(default_factory=dict)

    def text_config(self) -> Any:
        """The HF config of the text model being deployed, or None without a factory."""
        get_config = getattr(self.factory, "get_config", None)
        return fx_utils.text_config(get_config()) if callable(get_config) else None


class BaseTransform:
    """Base class of every transform. Subclasses implement ``_apply`` (per GraphModule) or
    override ``_apply_to_full_model`` (for transforms that run on the whole model, e.g. export)."""

    config: TransformConfig
    _key: ClassVar[str] = ""

    def __init__(self, config: TransformConfig):
        self.config = config

    @classmethod
    def get_config_class(cls) -> Type[TransformConfig]:
        """The configuration class for the transform (validates its YAML entry): the class its ``config:``
        annotation names."""
        config_cls = typing.get_type_hints(cls).get("config", TransformConfig)
        if not (isinstance(config_cls, type) and issubclass(config_cls, TransformConfig)):
            raise TypeError(f"{cls.__name__}.config must be annotated with a TransformConfig subclass")
        return config_cls

    @classmethod
    def get_transform_key(cls) -> str:
        return cls._key

    # -- to implement ------------------------------------------------------------------------
    def prepare(self, ctx: PipelineContext) -> None:
        """Called on every enabled transform the pipeline will run, before it runs any: where a transform
        lets an earlier one prepare for it, it leaves a note in ``ctx.extras`` (``quantize_weights`` lets
        ``load_weights`` keep a 16-bit checkpoint's linear weights as they are). Default: nothing."""

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        raise NotImplementedError(f"{type(self).__name__} implements neither _apply nor _apply_to_full_model")

    def _apply_to_full_model(self, mod: nn.Module, ctx: PipelineContext) -> tuple[nn.Module, TransformInfo]:
        """Default: apply per GraphModule when ``run_per_gm``, else once on the root GraphModule."""
        if self.config.run_per_gm:
            info: TransformInfo | None = None
            for name, gm in list(fx_utils.named_graphmodules(mod)):
                new_gm, gm_info = self._apply(gm, ctx)
                if new_gm is not gm:
                    mod = new_gm if name == "" else fx_utils.set_submodule(mod, name, new_gm)
                info = gm_info if info is None else info | gm_info
            return mod, info or TransformInfo.unchanged()
        if not isinstance(mod, GraphModule):
            raise AutoDeployError(f"transform {self._key!r} needs an exported graph; run the export stage first")
        return self._apply(mod, ctx)

    # -- the driver --------------------------------------------------------------------------
    def __call__(self, mod: nn.Module, ctx: PipelineContext) -> nn.Module:
        key, stage = self._key, self.config.stage
        history = dict(transform_history(mod))
        with transform_logging(stage.value, key):
            if not self.config.enabled:
                ad_logger.info("[SUMMARY] disabled")
                record = TransformRecord(key, stage, TransformInfo(skipped=True), disabled=True)
                _set_history(mod, {**history, key: record})
                graph_writer.record_disabled(key, stage.value)
                return mod

            start = time.perf_counter()
            mem_before = current_memory_bytes()
            self._pre_cleanup(mod, _last_info(history))
            try:
                mod, info = self._apply_to_full_model(mod, ctx)
            except AutoDeployError:
                raise
            except Exception as exc:  # noqa: BLE001 - skip_on_error is the user's explicit choice
                if not self.config.skip_on_error:
                    first_line = (str(exc).strip().splitlines() or [""])[0]
                    raise TransformError(
                        f"transform {key!r} (stage {stage.value}) failed: {type(exc).__name__}: {first_line}. "
                        f"Set AUTO_DEPLOY_LOG_LEVEL=DEBUG for the traceback, or "
                        f"--set transforms.{key}.skip_on_error=true to skip it"
                    ) from exc
                ad_logger.warning(f"skipped after error (skip_on_error=true): {type(exc).__name__}: {exc}")
                # the transform may have changed the graph before failing: assume neither clean nor
                # shape-valid, so post-cleanup / the next transform's pre-cleanup restore the invariants
                info = TransformInfo(skipped=True, is_clean=False, has_valid_shapes=False)
            info = self._post_cleanup(mod, info)
            elapsed = time.perf_counter() - start
            mem_delta = current_memory_bytes() - mem_before
            self._check_memory(mem_delta)

            record = TransformRecord(key, stage, info, time_s=elapsed, mem_delta_bytes=mem_delta)
            _set_history(mod, {**history, key: record})
            self._log_summary(info, elapsed)
            self._visualize(mod)
            graph_writer.dump_graph(mod, key, stage.value, record)
        return mod

    def _pre_cleanup(self, mod: nn.Module, prev: TransformInfo | None) -> None:
        """Restore the invariants this transform requires, where the last transform's info says they do not
        hold."""
        gms = list(fx_utils.named_graphmodules(mod))
        if gms and self.config.requires_clean_graph and not (prev and prev.is_clean):
            for _, gm in gms:
                fx_utils.canonicalize_graph(gm)
        if gms and self.config.requires_shape_prop and not (prev and prev.has_valid_shapes):
            for _, gm in gms:
                fx_utils.run_shape_prop(gm)

    def _post_cleanup(self, mod: nn.Module, info: TransformInfo) -> TransformInfo:
        gms = list(fx_utils.named_graphmodules(mod))
        if not gms:
            return info
        is_clean, has_valid_shapes = info.is_clean, info.has_valid_shapes
        if self.config.run_graph_cleanup and not is_clean:
            for _, gm in gms:
                fx_utils.canonicalize_graph(gm)
            is_clean = True
        if self.config.run_shape_prop and not has_valid_shapes:
            for _, gm in gms:
                fx_utils.run_shape_prop(gm)
            has_valid_shapes = True
        return info.model_copy(update={"is_clean": is_clean, "has_valid_shapes": has_valid_shapes})

    def _check_memory(self, delta: int) -> None:
        if self.config.expect_mem_change:
            if delta:
                ad_logger.info(f"memory change: {format_bytes(delta)}")
        elif abs(delta) > _MEM_WARN_BYTES:
            ad_logger.warning(
                f"memory changed by {format_bytes(delta)} although expect_mem_change=false for this transform"
            )

    def _log_summary(self, info: TransformInfo, elapsed: float) -> None:
        if info.skipped:
            ad_logger.info(f"[SUMMARY] skipped | time: {elapsed:.3f} s")
        else:
            ad_logger.info(f"[SUMMARY] matches={info.num_matches} | time: {elapsed:.3f} s")

    def _visualize(self, mod: nn.Module) -> None:
        if self.config.debug_visualize_dir:
            from ..utils.visualize import write_graph_visualization

            write_graph_visualization(mod, self.config.debug_visualize_dir, self._key)


def _last_info(history: dict[str, TransformRecord]) -> TransformInfo | None:
    for record in reversed(history.values()):
        if not record.disabled:
            return record.info
    return None


def _set_history(mod: nn.Module, history: dict[str, TransformRecord]) -> None:
    # object.__setattr__: keep the history out of nn.Module's parameter/submodule bookkeeping
    object.__setattr__(mod, HISTORY_ATTR, history)


class TransformRegistry:
    """Transform classes by key: ``@TransformRegistry.register("key")`` / ``TransformRegistry.get("key")``."""

    _registry: ClassVar[dict[str, Type[BaseTransform]]] = {}

    @classmethod
    def register(cls, key: str) -> Callable[[Type[BaseTransform]], Type[BaseTransform]]:
        def decorator(transform_cls: Type[BaseTransform]) -> Type[BaseTransform]:
            if key in cls._registry and cls._registry[key] is not transform_cls:
                raise ValueError(f"transform key {key!r} is already registered by {cls._registry[key].__name__}")
            transform_cls._key = key
            cls._registry[key] = transform_cls
            return transform_cls

        return decorator

    @classmethod
    def get(cls, key: str) -> Type[BaseTransform]:
        if key not in cls._registry:
            import difflib

            close = difflib.get_close_matches(key, cls._registry, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown transform key {key!r}{hint}")
        return cls._registry[key]

    @classmethod
    def has(cls, key: str) -> bool:
        return key in cls._registry

    @classmethod
    def keys(cls) -> list[str]:
        return list(cls._registry)

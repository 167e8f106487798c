"""The transform framework: stages, configs, the base class, the registry and the optimizer."""

from . import library  # noqa: E402,F401  (registers the transforms)
from .interface import (
    BaseTransform,
    PipelineContext,
    Stages,
    TransformConfig,
    TransformInfo,
    TransformRecord,
    TransformRegistry,
    transform_history,
)
from .optimizer import InferenceOptimizer

__all__ = [
    "BaseTransform",
    "InferenceOptimizer",
    "PipelineContext",
    "Stages",
    "TransformConfig",
    "TransformInfo",
    "TransformRecord",
    "TransformRegistry",
    "transform_history",
]

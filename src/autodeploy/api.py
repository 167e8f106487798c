"""The Python entry point: ``autodeploy.optimize``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from torch import nn

from .config import load_config
from .models import HFCheckpointFactory
from .transform import InferenceOptimizer, Stages


def optimize(
    model: str | Path | None = None,
    until: Stages | str | None = None,
    yaml_extra: Iterable[str | Path] | str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Run the pipeline on a checkpoint folder, up to and including stage ``until``.

    ``yaml_extra``: extra YAML files deep-merged over the default pipeline, in order.
    ``overrides``: ``{"dotted.key": value}`` applied last, e.g.
    ``{"transforms.export_to_gm.num_moe_experts_for_export": 2, "model_kwargs.num_hidden_layers": 1}``.

    Once weights are loaded, ``module(input_ids, position_ids)[0]`` are the logits [batch, seq, vocab].
    """
    if isinstance(yaml_extra, (str, Path)):
        yaml_extra = [yaml_extra]
    config = load_config(yaml_extra=yaml_extra, overrides=overrides, base={"model": str(model)} if model else None)
    optimizer, _ = build_optimizer(config)
    return optimizer(until=until)


def build_optimizer(config) -> tuple[InferenceOptimizer, HFCheckpointFactory | None]:
    factory = HFCheckpointFactory(config.model, config.model_kwargs, config.dtype) if config.model else None
    return InferenceOptimizer(config, factory=factory), factory

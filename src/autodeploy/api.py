"""The Python entry point: ``autodeploy.optimize``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from torch import nn

from .config import load_config
from .errors import ConfigError
from .models import HFCheckpointFactory
from .transform import InferenceOptimizer, Stages


def optimize(
    model: str | Path | None = None,
    until: Stages | str | None = None,
    yaml_extra: Iterable[str | Path] | str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    verify: bool = False,
    verify_atol: float | None = None,
    verify_rtol: float | None = None,
) -> nn.Module:
    """Run the pipeline on a checkpoint folder, up to and including stage ``until``.

    ``yaml_extra``: extra YAML files deep-merged over the default pipeline, in order.
    ``overrides``: ``{"dotted.key": value}`` applied last, e.g.
    ``{"transforms.export_to_gm.num_moe_experts_for_export": 2, "model_kwargs.num_hidden_layers": 1}``.

    Once weights are loaded, ``module(input_ids, position_ids)[0]`` are the logits [batch, seq, vocab].

    ``verify``: after every transform, compare the graph's logits with HF transformers' on seeded samples
    (tolerances: ``verify_atol`` / ``verify_rtol``, default by dtype); the first transform out of tolerance
    raises :class:`autodeploy.VerificationError`.
    """
    if isinstance(yaml_extra, (str, Path)):
        yaml_extra = [yaml_extra]
    config = load_config(yaml_extra=yaml_extra, overrides=overrides, base={"model": str(model)} if model else None)
    options = verify_options(verify, verify_atol, verify_rtol)
    optimizer, _ = build_optimizer(config, verify=options)
    return optimizer(until=until)


def verify_options(verify: bool, atol: float | None, rtol: float | None):
    """The optimizer's ``verify`` argument: None when off; tolerances must be >= 0."""
    for name, value in (("verify_atol", atol), ("verify_rtol", rtol)):
        if value is not None and not value >= 0:
            raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
    if not verify:
        return None
    from .verify import VerifyOptions

    return VerifyOptions(atol=atol, rtol=rtol)


def build_optimizer(config, verify=None) -> tuple[InferenceOptimizer, HFCheckpointFactory | None]:
    """The optimizer for ``config`` and its checkpoint factory; ``verify``: :class:`autodeploy.verify.VerifyOptions`."""
    factory = HFCheckpointFactory(config.model, config.model_kwargs, config.dtype) if config.model else None
    return InferenceOptimizer(config, factory=factory, verify=verify), factory

"""Loading the pipeline configuration: default YAML, extra YAML files, dotted overrides.

Order: the packaged ``default.yaml``, then each ``yaml_extra`` file deep-merged in order, then each
``--set dotted.key=value`` override. Every error names the key, the field and where the value came from.
"""

from __future__ import annotations

import copy
import difflib
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from ..errors import ConfigError

DEFAULT_YAML = "default.yaml"
_DTYPES = ("auto", "float32", "bfloat16", "float16")


class AutoDeployConfig(BaseModel):
    """The whole configuration; ``transforms`` entries are validated by each transform's own class."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="Checkpoint folder (config.json + *.safetensors) or hub id.")
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="Overrides of the model's config.json.")
    dtype: str = Field(default="auto", description="auto (checkpoint dtype), float32, bfloat16 or float16.")
    device: str = Field(default="cpu", description="Device the weights are loaded to.")
    max_batch_size: int = Field(default=8, ge=1, description="Largest batch the exported graph serves.")
    max_seq_len: int = Field(default=512, ge=2, description="Longest sequence the exported graph serves.")
    world_size: int = Field(default=1, ge=1, description="Ranks (processes) the model is split across.")
    transforms: dict[str, dict[str, Any]] = Field(default_factory=dict)

    # Where each dotted key was last set (file or --set), for error messages.
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in _DTYPES:
            raise ValueError(f"must be one of {', '.join(_DTYPES)}")
        return value

    @field_validator("device")
    @classmethod
    def _usable_device(cls, value: str) -> str:
        import torch

        try:
            device = torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError("not a torch device (e.g. cpu, cuda, cuda:1)") from None
        is_available = getattr(getattr(torch, device.type, None), "is_available", None)
        if device.type != "cpu" and callable(is_available) and not is_available():
            raise ValueError(f"{device.type} is not available on this machine")
        return value

    def source_of(self, dotted: str) -> str:
        """The file (or --set) that last set ``dotted`` or its closest parent."""
        return _lookup_source(dotted, self._sources)


def default_yaml_text() -> str:
    return resources.files("autodeploy.config").joinpath(DEFAULT_YAML).read_text()


def _read_yaml_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, expected a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (e.g. 'transforms:'), got {type(data).__name__}")
    return data


def deep_merge(base: dict, extra: Mapping, source: str, sources: dict[str, str], prefix: str = "") -> dict:
    """Merge ``extra`` into ``base`` recursively (mappings merge, everything else replaces)."""
    for key, value in extra.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            deep_merge(base[key], value, source, sources, prefix=f"{dotted}.")
        else:
            base[key] = copy.deepcopy(value)
            sources[dotted] = source
    return base


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], parsed value); the value is read as YAML (true, 3, [1, 2])."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    key, _, raw = text.partition("=")
    path = [p for p in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"--set {text!r}: empty key segment in {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return path, value


def _apply_override(data: dict, path: list[str], value: Any, source: str, sources: dict[str, str]) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
            sources[".".join(path[: i + 1])] = source  # a key this override introduced (e.g. a new transform)
        elif not isinstance(child, dict):
            raise ConfigError(f"{source}: {'.'.join(path[: i + 1])} is not a mapping, cannot set {'.'.join(path)}")
        node = child
    dotted = ".".join(path)
    if isinstance(value, Mapping) and isinstance(node.get(path[-1]), dict):
        # a mapping merges into the existing one (a nested dict must not drop the rest of the pipeline)
        deep_merge(node[path[-1]], value, source, sources, prefix=f"{dotted}.")
        return
    node[path[-1]] = value
    sources[dotted] = source


def load_config(
    yaml_extra: Iterable[str | Path] | None = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> AutoDeployConfig:
    """Build the configuration: default YAML <- ``base`` dict <- extra files <- overrides.

    ``overrides`` is either ``{"dotted.key": value}`` (Python API) or ``["dotted.key=value"]`` (CLI).
    """
    sources: dict[str, str] = {}
    data = yaml.safe_load(default_yaml_text())
    if base:
        deep_merge(data, base, "the Python arguments", sources)
    for path in yaml_extra or ():
        deep_merge(data, _read_yaml_file(path), str(path), sources)
    if overrides:
        from_api = isinstance(overrides, Mapping)
        items = overrides.items() if from_api else (parse_override(o) for o in overrides)
        for key, value in items:
            key_path = key.split(".") if isinstance(key, str) else key
            dotted = ".".join(key_path)
            source = f"overrides[{dotted!r}]" if from_api else f"--set {dotted}"
            _apply_override(data, key_path, value, source, sources)

    if not isinstance(data.get("transforms"), dict):
        raise ConfigError(
            f"'transforms' must be a mapping of transform key to its config "
            f"({sources.get('transforms', DEFAULT_YAML)})"
        )
    for key, entry in data["transforms"].items():
        if entry is None:
            data["transforms"][key] = {}
        elif not isinstance(entry, dict):
            raise ConfigError(
                f"transforms.{key} must be a mapping of fields (e.g. 'stage: ...'), got {entry!r} "
                f"({sources.get(f'transforms.{key}', DEFAULT_YAML)})"
            )
    try:
        config = AutoDeployConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc, sources, AutoDeployConfig.model_fields)) from None
    config._sources = sources
    return config


def _describe_validation_error(exc: ValidationError, sources: dict[str, str], fields: Mapping, prefix: str = "") -> str:
    """One line per problem: the dotted key, what is wrong, and which file/--set it came from."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        dotted = f"{prefix}{loc}"
        source = _lookup_source(dotted, sources)
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"unknown config key {dotted!r}{hint} (from {source})")
        else:
            got = err.get("input")
            lines.append(f"{dotted}: {err['msg']}, got {got!r} (from {source})")
    return "invalid configuration:\n  " + "\n  ".join(lines) if len(lines) > 1 else "invalid configuration: " + lines[0]


def _lookup_source(dotted: str, sources: Mapping[str, str]) -> str:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        found = sources.get(".".join(parts[:n]))
        if found:
            return found
    return DEFAULT_YAML


def describe_transform_validation_error(
    key: str, exc: ValidationError, config: AutoDeployConfig, fields: Mapping
) -> str:
    return _describe_validation_error(exc, config._sources, fields, prefix=f"transforms.{key}.")

"""A registry of well-known models (``registry.yaml``): hub id, architecture, the config extras they need.

``verified`` is computed, never read from the data file: an entry is verified when its architecture is one
the test suite checks end to end against HF transformers (:data:`VERIFIED_ARCHITECTURES`): the suite's
tiny checkpoints (tests keep :data:`SUITE_ARCHITECTURES` equal to ``tests/tiny_models.py``'s ``ARCH_CONFIGS``)
and the family representatives that must pass every column of the coverage table
(:data:`FAMILY_ARCHITECTURES`, kept equal to ``tests/models/test_families.py``'s).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError

#: the architectures (transformers model_type) of the suite's tiny checkpoints, checked against HF end to end
SUITE_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe"})
#: the architectures tests/models/test_families.py runs through every coverage column (export, canonical,
#: logits and generate against HF)
FAMILY_ARCHITECTURES = frozenset({
    "gpt2", "llama", "qwen3", "mixtral", "phi3", "gpt_neox", "gptj", "cohere", "falcon", "nanochat", "gemma4_text",
    "deepseek_v2", "deepseek_v3", "mamba", "jamba", "bamba", "lfm2", "qwen3_next", "bloom", "mpt", "gpt_neo", "xglm",
    "granite_swa", "mimo_v2_flash", "hrm_text", "gemma3n_text", "beam",
})
VERIFIED_ARCHITECTURES = SUITE_ARCHITECTURES | FAMILY_ARCHITECTURES

_FIELDS = {"id", "architecture", "extras", "notes"}


@dataclass(frozen=True)
class ModelEntry:
    id: str
    architecture: str
    extras: dict[str, Any] = field(default_factory=dict)
    notes: str = ""

    @property
    def verified(self) -> bool:
        return self.architecture in VERIFIED_ARCHITECTURES

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "architecture": self.architecture, "extras": dict(self.extras),
                "verified": self.verified, "notes": self.notes}

    def extras_yaml(self) -> str:
        """The extras as a nested YAML document (a ``--yaml-extra`` file)."""
        nested: dict[str, Any] = {}
        for key, value in self.extras.items():
            *parents, leaf = key.split(".")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return yaml.safe_dump(nested, sort_keys=False)


def parse_registry(text: str) -> list[ModelEntry]:
    data = yaml.safe_load(text) or {}
    entries = []
    for raw in data.get("models", []):
        unknown = set(raw) - _FIELDS
        if unknown:  # notably `verified`: computed, never hand-written
            raise ConfigError(f"registry entry {raw.get('id')!r}: unknown field(s) {sorted(unknown)}")
        entries.append(ModelEntry(id=raw["id"], architecture=raw["architecture"],
                                  extras=dict(raw.get("extras") or {}), notes=raw.get("notes", "")))
    ids = [e.id for e in entries]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"registry: duplicate id(s) {dupes}")
    return entries


@lru_cache(maxsize=1)
def _packaged() -> tuple[ModelEntry, ...]:
    return tuple(parse_registry(resources.files(__package__).joinpath("registry.yaml").read_text()))


def list_models() -> list[ModelEntry]:
    return list(_packaged())


def _checkpoint_names(model: str) -> list[str]:
    """A checkpoint folder's own names for itself: config.json's ``_name_or_path``."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return []
    try:
        name = json.loads(config.read_text()).get("_name_or_path")
    except (OSError, ValueError):
        return []
    return [name] if isinstance(name, str) and name else []


def find_model(model: str, entries: list[ModelEntry] | None = None) -> ModelEntry:
    """The entry ``model`` names: its hub id (case-insensitive), or a checkpoint folder whose config.json
    ``_name_or_path`` is one. Unknown: a :class:`ConfigError` listing close matches."""
    entries = list_models() if entries is None else entries
    by_id = {e.id.lower(): e for e in entries}
    for name in [model, *_checkpoint_names(model)]:
        if name.lower() in by_id:
            return by_id[name.lower()]
    close = difflib.get_close_matches(model.lower(), list(by_id), n=5, cutoff=0.4)
    hint = ("; close matches: " + ", ".join(by_id[c].id for c in close)) if close else ""
    raise ConfigError(f"--use-registry: {model!r} is not in the model registry (see `autodeploy models`){hint}")


def table(entries: list[ModelEntry]) -> str:
    rows = [("MODEL", "ARCHITECTURE", "VERIFIED", "EXTRAS")]
    for e in entries:
        extras = " ".join(f"{k}={v}" for k, v in e.extras.items()) or "-"
        rows.append((e.id, e.architecture, "yes" if e.verified else "no", extras))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    verified = sum(e.verified for e in entries)
    lines.append(f"{len(entries)} models, {verified} of an architecture the test suite checks end to end against "
                 f"HF (its tiny checkpoints and tests/models/test_families.py); docs/models.md has the rest")
    return "\n".join(lines) + "\n"

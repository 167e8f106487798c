"""Model factory for Hugging Face causal-LM checkpoints (a folder with config.json + *.safetensors).

The factory builds the model skeleton on the meta device (no weight memory), provides example
inputs and dynamic shapes for export, and loads the checkpoint's weights when asked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..utils.fx import text_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFCheckpointFactory:
    """Everything the pipeline needs to know about one HF checkpoint."""

    def __init__(self, model: str | Path, model_kwargs: dict[str, Any] | None = None, dtype: str = "auto"):
        self.model = str(model)
        self.model_kwargs = dict(model_kwargs or {})
        self.dtype_name = dtype
        self._config = None
        self._checkpoint_dtype = torch.float32

    # -- checkpoint --------------------------------------------------------------------------
    @property
    def path(self) -> Path | None:
        path = Path(self.model).expanduser()
        return path if path.exists() else None

    def _check_folder(self) -> None:
        path = Path(self.model).expanduser()
        looks_like_path = self.model.startswith((".", "/", "~")) or path.exists() or self.model.count("/") != 1
        if not path.exists():
            if looks_like_path:
                raise CheckpointError(f"model folder not found: {self.model}")
            return  # a hub id ("org/name"): transformers resolves it where a hub is reachable
        if not path.is_dir():
            raise CheckpointError(f"--model must be a checkpoint folder, got a file: {path}")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint folder")

    def checkpoint_files(self) -> list[Path]:
        """The safetensors files of the checkpoint (the shards listed by the index when sharded)."""
        path = self.path
        if path is None:
            raise CheckpointError(f"model folder not found: {self.model}")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
            files = sorted({path / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
            return files
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} has no *.safetensors weights")
        return files

    # -- config and skeleton ---------------------------------------------------------------------
    def get_config(self):
        """The HF config with ``model_kwargs`` applied; unknown override keys are an error."""
        if self._config is None:
            from transformers import AutoConfig

            self._check_folder()
            try:
                config = AutoConfig.from_pretrained(self.model)
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"cannot read the model config of {self.model}: {exc}") from None
            for key, value in self.model_kwargs.items():
                if not hasattr(config, key):
                    raise CheckpointError(
                        f"model_kwargs.{key} is not a field of {type(config).__name__} ({self.model}/config.json)"
                    )
                try:
                    setattr(config, key, value)
                except Exception as exc:  # noqa: BLE001 - transformers' strict config fields raise their own types
                    reason = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else type(exc).__name__
                    raise ConfigError(
                        f"model_kwargs.{key}={value!r} is not valid for {type(config).__name__}: {reason}"
                    ) from None
            self._config = config
            # read now: building a model from the config sets its dtype to the built one
            self._checkpoint_dtype = _config_dtype(config)
        return self._config

    @property
    def dtype(self) -> torch.dtype:
        """The graph's dtype: the configured one, or with ``auto`` the checkpoint's."""
        if self.dtype_name != "auto":
            return _DTYPES[self.dtype_name]
        return self.checkpoint_dtype

    @property
    def checkpoint_dtype(self) -> torch.dtype:
        """The dtype the checkpoint stores its weights in (config.json's ``dtype``; float32 if it names none)."""
        self.get_config()
        return self._checkpoint_dtype

    def build_model(self, device: str | torch.device = "meta") -> nn.Module:
        """The HF model skeleton; on the meta device no weight memory is allocated."""
        from transformers import AutoModelForCausalLM

        config = self.get_config()
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
            except ValueError as exc:
                raise CheckpointError(
                    f"{self.model}: not a causal language model transformers can build ({exc})"
                ) from None
        return model.eval()

    # -- weights ---------------------------------------------------------------------------------
    def load_state(self, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """All parameters and buffers of the model, by FQN, loaded from the checkpoint, in ``dtype``
        (default: the graph's, :attr:`dtype`).

        transformers' own loader does the checkpoint-to-model key conversions (renamed keys, per-expert
        tensors stacked into 3D expert weights, tied embeddings), so any architecture it supports works.
        Missing, unexpected and wrongly shaped tensors are errors naming them.
        """
        from transformers import AutoModelForCausalLM

        if self.path is not None:  # a local folder: clear error when it has no weights (hub ids resolve remotely)
            self.checkpoint_files()
        model, loading_info = AutoModelForCausalLM.from_pretrained(
            self.model,
            config=self.get_config(),
            dtype=dtype or self.dtype,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
        self._raise_on_bad_keys(loading_info)
        state = dict(model.named_parameters(remove_duplicate=False))
        state.update(model.named_buffers(remove_duplicate=False))
        device = torch.device(device)
        return {name: t.detach().to(device) for name, t in state.items()}

    def _raise_on_bad_keys(self, info: dict[str, Any]) -> None:
        problems = []
        mismatched = info.get("mismatched_keys") or []
        if mismatched:
            details = [f"{k} (checkpoint {tuple(a)} vs model {tuple(b)})" for k, a, b in _shape_triples(mismatched)]
            problems.append("wrongly shaped tensor(s): " + ", ".join(details))
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            problems.append("missing tensor(s): " + ", ".join(missing))
        unexpected = sorted(info.get("unexpected_keys") or [])
        if unexpected and not self.model_kwargs:
            problems.append("unexpected tensor(s) the model does not use: " + ", ".join(unexpected))
        if problems:
            raise CheckpointError(f"checkpoint {self.model} does not match the model: " + "; ".join(problems))
        if unexpected:
            from ..utils.logger import ad_logger

            ad_logger.warning(
                f"ignored {len(unexpected)} checkpoint tensor(s) not used with model_kwargs={self.model_kwargs}: "
                + ", ".join(unexpected[:8])
                + (" ..." if len(unexpected) > 8 else "")
            )


def _config_dtype(config) -> torch.dtype:
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    return config_dtype if isinstance(config_dtype, torch.dtype) else torch.float32


def _shape_triples(mismatched):
    for item in mismatched:
        if isinstance(item, (tuple, list)) and len(item) == 3:
            yield item
        else:
            yield str(item), (), ()


def checkpoint_eos_token_ids(path: Path, factory) -> list[int] | None:
    """The EOS ids of the checkpoint at ``path``: its generation_config's, else its config's."""
    eos = None
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None and factory is not None:
        eos = getattr(text_config(factory.get_config()), "eos_token_id", None)
    if eos is None:
        return None
    return [eos] if isinstance(eos, int) else list(eos)

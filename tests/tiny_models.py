"""Tiny random-weight HF checkpoints for tests (no hub): ``from_config`` + ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mixtral": ("MixtralConfig", {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
}
ARCHS = list(ARCH_CONFIGS)


def make_config(arch: str, **overrides):
    import transformers

    class_name, extra = ARCH_CONFIGS[arch]
    return getattr(transformers, class_name)(**{**_COMMON, **extra, **overrides})


def save_tiny_checkpoint(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Build a random-weight model of ``arch`` and save it (fp32 safetensors) to ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, **overrides), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def hf_reference(path: Path):
    """The oracle: the checkpoint loaded by HF transformers itself, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_batch(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    position_ids = torch.arange(seq).expand(batch, seq)
    return input_ids, position_ids

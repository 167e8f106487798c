"""The oracle of ``--verify``: HF transformers' own model of the checkpoint, loaded once, and its logits on
a few seeded samples.

Two sets of samples, because the graph has two contracts: before ``cache_init`` it takes padded batches
``(input_ids [b, s], position_ids [b, s])`` (:attr:`Samples.batches`, of different batch sizes and lengths);
after it, sequences flattened with cache metadata: :attr:`Samples.sequences` are prefilled (their first
``prompt_len`` tokens) and then decoded one given token at a time, and compared with HF's logits of the
whole sequence at the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import AutoDeployError

#: (batch, seq) of the batches, clipped to max_batch_size / max_seq_len
BATCH_SHAPES = ((1, 7), (3, 5), (2, 16))
#: (prompt length, decode steps) of the sequences
SEQUENCE_SHAPES = ((6, 3), (11, 3))
SEED = 0


@dataclass
class Outputs:
    """Logits on the samples: one tensor per batch [b, s, vocab] and per sequence [len, vocab] (either list
    may be empty when the graph's contract does not produce it)."""

    batches: list[torch.Tensor] = field(default_factory=list)
    sequences: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Samples:
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # (input_ids, position_ids)
    sequences: list[list[int]]  # whole token sequences
    prompt_lens: list[int]

    @property
    def decode_steps(self) -> int:
        return min(len(s) - p for s, p in zip(self.sequences, self.prompt_lens))


def make_samples(vocab_size: int, max_batch_size: int, max_seq_len: int, seed: int = SEED) -> Samples:
    gen = torch.Generator().manual_seed(seed)
    batches, shapes = [], sorted({(min(b, max_batch_size), min(s, max_seq_len)) for b, s in BATCH_SHAPES})
    for b, s in shapes:
        ids = torch.randint(0, vocab_size, (b, s), generator=gen)
        batches.append((ids, torch.arange(s).expand(b, s)))
    sequences, prompt_lens = [], []
    for prompt_len, steps in SEQUENCE_SHAPES[:max_batch_size]:
        total = min(prompt_len + steps, max_seq_len)
        prompt_len = max(1, total - steps)
        sequences.append(torch.randint(0, vocab_size, (total,), generator=gen).tolist())
        prompt_lens.append(prompt_len)
    return Samples(batches, sequences, prompt_lens)


def load_oracle(factory) -> nn.Module:
    """The checkpoint as HF transformers loads it, in the pipeline's dtype, eval mode."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(factory.model, config=factory.get_config(),
                                                    dtype=factory.dtype).eval()
    except (OSError, ValueError) as exc:
        raise AutoDeployError(f"--verify: HF transformers cannot load {factory.model} as the reference: "
                              f"{exc}") from None


def oracle_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name (tied weights under each of their names): the
    checkpoint's weights for graphs whose own are still on the meta device."""
    tensors = {n: t.detach() for n, t in model.named_parameters(remove_duplicate=False)}
    tensors.update((n, t.detach()) for n, t in model.named_buffers(remove_duplicate=False))
    return tensors


@torch.no_grad()
def oracle_outputs(model: nn.Module, samples: Samples) -> Outputs:
    def logits(ids, pos):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    out = Outputs()
    out.batches = [logits(ids, pos) for ids, pos in samples.batches]
    out.sequences = [logits(torch.tensor([s]), torch.arange(len(s))[None])[0] for s in samples.sequences]
    return out

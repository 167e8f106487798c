"""Sampling the next token of each sequence from its last-token logits.

:class:`SamplingParams` holds one request's settings; :func:`sample` draws one token per row of the
gathered logits ``[num_seqs, vocab]``:

- ``temperature == 0`` (or ``top_k == 1``): greedy, ``argmax`` (ties: the lowest token id);
- otherwise ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens
  (``top_k == 0``: all) and then to the smallest set of most likely tokens whose probability reaches
  ``top_p`` (nucleus), renormalized, and one draw from it.

Each request draws from its own ``torch.Generator`` seeded with ``SamplingParams.seed`` (a random seed
when None), exactly one draw per generated token, so a seeded request produces the same tokens whatever
else is batched with it.

:func:`suppress_tokens` keeps EOS and stop tokens from being drawn before ``min_tokens``;
:func:`token_logprobs` gives the log-probabilities of chosen tokens and the top-N alternatives, from the
model's raw distribution (``log_softmax`` of the logits, before temperature, top-k or top-p).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

#: the most top-N alternatives ``logprobs`` / ``prompt_logprobs`` return per token
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How one request generates (the familiar LLM-API shape).

    ``max_tokens``: tokens to generate at most (None: up to ``max_seq_len``);
    ``temperature``: 0 is greedy; ``top_k``: 0 disables; ``top_p``: 1.0 disables;
    ``seed``: per-request generator seed (reproducible sampling); ``stop_token_ids``: generation ends
    after any of these (the token is kept in the output); ``ignore_eos``: don't stop at the model's EOS;
    ``stop``: strings that end generation (the text ends before the first one; needs a tokenizer);
    ``min_tokens``: EOS, stop tokens and stop strings are not honoured before this many tokens;
    ``logprobs``: the log-probability of each generated token plus the top-N alternatives (N = the
    value, 0: the chosen token's only); ``prompt_logprobs``: the same for the prompt's tokens (the first
    has none).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def problem(self) -> str | None:
        """What is wrong with these values (a message naming the field), or None."""
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            return f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}"
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            return f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}"
        if not isinstance(self.top_k, int) or self.top_k < 0:
            return f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}"
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}"
        if self.seed is not None and not isinstance(self.seed, int):
            return f"seed must be an integer or None, got {self.seed!r}"
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            return f"stop_token_ids must be integers, got {self.stop_token_ids!r}"
        if not all(isinstance(t, str) and t for t in self.stop):
            return f"stop must be non-empty strings, got {self.stop!r}"
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            return f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                return f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or None), got {value!r}"
        return None

    def validate(self) -> "SamplingParams":
        """Raise ``ValueError`` if a value is invalid; returns self."""
        problem = self.problem()
        if problem:
            raise ValueError(problem)
        return self


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request: seeded with ``seed``, or with a fresh random seed when None."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else random.getrandbits(63))
    return gen


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The probabilities one non-greedy draw uses, for one row of logits [vocab] (float32)."""
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep a token while the mass before it is below top_p (the most likely token is always kept)
        drop_sorted = (cum - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def _argmax_rows(rows: torch.Tensor) -> list[int]:
    """``rows.argmax(-1)`` as a list (ties and NaN: the first). CPU float32 rows go through numpy's
    vectorized argmax, faster than torch's for the one row per sequence of a decode step (figures in
    docs/performance.md); other rows through torch's."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and not rows.requires_grad:
        return rows.numpy().argmax(axis=-1).tolist()
    return rows.argmax(dim=-1).tolist()


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` [num_seqs, vocab], row i with ``params[i]`` / ``generators[i]``."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} for {len(params)} params / {len(generators)} generators"
        )
    out = [0] * len(params)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        rows = logits if len(greedy_rows) == len(params) else logits[greedy_rows]  # all greedy: no copy
        picked = _argmax_rows(rows)
        for i, tok in zip(greedy_rows, picked):
            out[i] = int(tok)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        gen = generators[i]
        row = logits[i]
        if gen is not None and gen.device != row.device:
            row = row.to(gen.device)
        probs = filter_logits(row, p.temperature, p.top_k, p.top_p)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out


@dataclass
class TokenLogprob:
    """One token's log-probability and the ``top`` most likely tokens at its position, ``[(id, logprob)]``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """For each row of ``logits`` [n, vocab]: the log-probability of ``token_ids[i]`` and the ``top_n`` most
    likely tokens (the model's raw distribution: ``log_softmax`` of the logits)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.as_tensor(list(token_ids), dtype=torch.long, device=logp.device)[:, None])
    chosen = chosen[:, 0].tolist()
    if top_n > 0:
        values, ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in chosen]
    return [TokenLogprob(int(t), lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


def suppress_tokens(logits: torch.Tensor, rows_tokens: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
    """``logits`` with ``-inf`` at ``(row, token)`` for each ``(row, tokens)`` (a copy when there is any)."""
    if not any(tokens for _, tokens in rows_tokens):
        return logits
    logits = logits.clone()
    for row, tokens in rows_tokens:
        if tokens:
            logits[row, list(tokens)] = float("-inf")
    return logits

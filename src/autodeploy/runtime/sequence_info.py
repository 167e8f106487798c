"""The sequence interface: what one forward call of the cached graph is given.

After the ``cache_init`` stage the graph runs a batch of sequences flattened into one token stream, so
prefill requests (many new tokens) and decode requests (one new token) share one forward:

    gm(input_ids, position_ids, seq_lens, input_pos, page_table[, slot_idx], logits_idx) -> (logits,)

====================  ==========================  ======  ===============================================
input                 shape                       dtype   meaning
====================  ==========================  ======  ===============================================
``input_ids``         [1, total_tokens]           int64   new tokens, sequence after sequence
``position_ids``      [1, total_tokens]           int64   position of each token (``input_pos + i``)
``seq_lens``          [num_seqs]                  int32   new tokens per sequence
``input_pos``         [num_seqs]                  int32   tokens already cached per sequence
``page_table``        [num_seqs, P]               int32   cache pages per sequence (padded with 0); P: the
                                                          pages the batch's longest sequence needs
``slot_idx``          [num_seqs]                  int32   state-cache slot per sequence (only graphs with
                                                          state-space layers, ``insert_cached_ssm``)
``logits_idx``        [num_logits]                int64   token indices whose logits are returned
====================  ==========================  ======  ===============================================

``logits`` is [1, num_logits, vocab] (``logits_idx`` is only an input when the graph gathers logits,
``insert_cached_attention.gather_logits``; otherwise logits is [1, total_tokens, vocab]).

:class:`SequenceInfo` holds the limits (max batch size, max sequence length, page size, number of
pages) and builds these tensors from a list of :class:`SequenceRequest`; :class:`PagePool` hands out
cache pages. Scheduling (which requests run together) is the runtime's business, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import torch

#: the graph's inputs after ``cache_init``, in placeholder order; a graph with a state cache (``insert_cached_ssm``)
#: also has :data:`SLOT_IDX`, right after ``page_table``
GRAPH_INPUTS = ("input_ids", "position_ids", "seq_lens", "input_pos", "page_table", "logits_idx")
#: the metadata inputs ``insert_cached_attention`` (or ``insert_cached_ssm``) adds
METADATA_INPUTS = ("seq_lens", "input_pos", "page_table")
SLOT_IDX = "slot_idx"
LOGITS_IDX = "logits_idx"


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence's share of a forward call.

    ``token_ids``: the new tokens (the whole prompt, a prompt chunk, or the one token to decode);
    ``input_pos``: how many tokens of this sequence are already in the cache;
    ``pages``: the sequence's cache pages in order, covering at least ``input_pos + len(token_ids)``;
    ``all_logits``: the logits of every new token are returned, not only the last one's (prompt logprobs);
    ``slot``: the sequence's state-cache slot (graphs with state-space layers), its own while it runs.
    """

    token_ids: Sequence[int]
    input_pos: int
    pages: Sequence[int]
    all_logits: bool = False
    slot: int = 0


@dataclass
class BatchInputs:
    """The tensors of one forward call (see the module docstring)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: torch.Tensor
    input_pos: torch.Tensor
    page_table: torch.Tensor
    slot_idx: torch.Tensor | None = None
    logits_idx: torch.Tensor | None = None

    def as_kwargs(self, include_logits_idx: bool = True) -> dict[str, torch.Tensor]:
        """Keyword arguments for the graph (``gm(**batch.as_kwargs())``); ``slot_idx`` when it was built."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if not include_logits_idx or out[LOGITS_IDX] is None:
            out.pop(LOGITS_IDX)
        if out[SLOT_IDX] is None:
            out.pop(SLOT_IDX)
        return out

    def as_args(self, include_logits_idx: bool = True) -> tuple[torch.Tensor, ...]:
        """Positional arguments in :data:`GRAPH_INPUTS` order."""
        return tuple(self.as_kwargs(include_logits_idx).values())

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def last_token_idx(seq_lens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Index of each sequence's last token in the flattened stream (int64): ``cumsum(seq_lens) - 1``."""
    lens = torch.as_tensor(seq_lens, dtype=torch.long)
    return torch.cumsum(lens, 0) - 1


def _logits_rows(requests: Sequence[SequenceRequest]) -> list[int]:
    """The tokens whose logits a forward returns: each sequence's last one, or all of them for a sequence
    with ``all_logits``, in order."""
    idx, start = [], 0
    for r in requests:
        n = len(r.token_ids)
        idx.extend(range(start, start + n) if r.all_logits else (start + n - 1,))
        start += n
    return idx


def logits_token_idx(requests: Sequence[SequenceRequest]) -> torch.Tensor:
    """:func:`_logits_rows` as an int64 tensor."""
    return torch.tensor(_logits_rows(requests), dtype=torch.long)


class SequenceInfo:
    """Limits of the cached graph and the builder of its per-forward inputs."""

    def __init__(
        self,
        max_batch_size: int,
        max_seq_len: int,
        page_size: int,
        num_pages: int,
        max_num_tokens: int | None = None,
    ):
        if min(max_batch_size, max_seq_len, page_size) < 1 or num_pages < 0:
            raise ValueError("SequenceInfo: max_batch_size, max_seq_len, page_size must be >= 1, num_pages >= 0")
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_num_tokens = max_num_tokens if max_num_tokens is not None else max_batch_size * max_seq_len
        self._decode_inputs: dict[tuple, _DecodeInputs] = {}
        self._last_decode: _DecodeInputs | None = None  # what the last ``build(reuse=True)`` of a decode batch filled

    @classmethod
    def from_spec(cls, spec) -> "SequenceInfo":
        """From a :class:`autodeploy.runtime.kv_cache.KVCacheSpec` (``gm.meta['kv_cache']``)."""
        return cls(spec.max_batch_size, spec.max_seq_len, spec.page_size, spec.num_pages)

    @property
    def max_pages_per_seq(self) -> int:
        return self.pages_needed(self.max_seq_len)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens of one sequence."""
        return -(-num_tokens // self.page_size)

    def __repr__(self) -> str:
        return (
            f"SequenceInfo(max_batch_size={self.max_batch_size}, max_seq_len={self.max_seq_len}, "
            f"page_size={self.page_size}, num_pages={self.num_pages})"
        )

    def _check(self, requests: Sequence[SequenceRequest]) -> None:
        if not requests:
            raise ValueError("a forward needs at least one sequence")
        if len(requests) > self.max_batch_size:
            raise ValueError(f"{len(requests)} sequences exceed max_batch_size={self.max_batch_size}")
        total = sum(len(r.token_ids) for r in requests)
        if total > self.max_num_tokens:
            raise ValueError(f"{total} tokens exceed max_num_tokens={self.max_num_tokens}")
        for i, r in enumerate(requests):
            end = r.input_pos + len(r.token_ids)
            if r.input_pos < 0 or not r.token_ids:
                raise ValueError(f"sequence {i}: needs >= 1 new token and input_pos >= 0")
            if end > self.max_seq_len:
                raise ValueError(f"sequence {i}: {end} tokens exceed max_seq_len={self.max_seq_len}")
            if len(r.pages) < self.pages_needed(end):
                raise ValueError(f"sequence {i}: {end} tokens need {self.pages_needed(end)} pages, got {len(r.pages)}")
            if len(r.pages) > self.max_pages_per_seq:
                raise ValueError(
                    f"sequence {i}: {len(r.pages)} pages exceed max_pages_per_seq={self.max_pages_per_seq}"
                )
            bad = [p for p in r.pages if not 0 <= p < self.num_pages]
            if bad:
                raise ValueError(f"sequence {i}: page(s) {bad} outside the cache's {self.num_pages} pages")
            if not 0 <= r.slot < self.max_batch_size:
                raise ValueError(f"sequence {i}: state slot {r.slot} outside the {self.max_batch_size} slots")

    def build(
        self,
        requests: Iterable[SequenceRequest | tuple],
        gather: str | None = "last",
        device: torch.device | str = "cpu",
        slots: bool = False,
        min_width: int = 1,
        reuse: bool = False,
    ) -> BatchInputs:
        """The graph inputs for one forward over ``requests`` (``SequenceRequest`` or
        ``(token_ids, input_pos, pages)`` tuples). ``gather``: ``"last"`` (logits of each sequence's last
        token, or of all its tokens with ``all_logits``), ``"all"`` (every token's) or None (no
        ``logits_idx``, for graphs that don't gather); ``slots``: with ``slot_idx`` (graphs with a state
        cache); ``min_width``: page-table columns at least (padded with page 0).

        ``reuse``: a batch of one token per sequence on CPU is written into tensors kept for its shape and
        returned again by the next such call, which overwrites them (the engine's decode steps: 18 us a step
        against 48 us for new tensors, docs/performance.md); the caller must be done with the batch by then."""
        reqs = [r if isinstance(r, SequenceRequest) else SequenceRequest(*r) for r in requests]
        self._check(reqs)
        self._last_decode = None
        if reuse and torch.device(device).type == "cpu" and gather in ("last", None) and all(
                len(r.token_ids) == 1 and not r.all_logits for r in reqs):
            return self._decode_batch(reqs, gather == "last", slots, min_width)
        # plain lists first, then one tensor each: a decode step builds these every token, and each torch call
        # costs more than the Python around it (the graph's weights have just pushed torch's code out of cache)
        ids: list[int] = []
        positions: list[int] = []
        for r in reqs:
            ids.extend(int(t) for t in r.token_ids)
            positions.extend(range(r.input_pos, r.input_pos + len(r.token_ids)))
        seq_lens = [len(r.token_ids) for r in reqs]
        # as wide as the batch's longest sequence needs: attention over the table costs by its width
        width = max(min_width, *(self.pages_needed(r.input_pos + len(r.token_ids)) for r in reqs))
        rows = []
        for r in reqs:
            pages = [int(p) for p in r.pages[:width]]
            rows.append(pages + [0] * (width - len(pages)))
        if gather == "last":
            logits_idx = _logits_rows(reqs)
        elif gather == "all":
            logits_idx = list(range(len(ids)))
        elif gather is None:
            logits_idx = None
        else:
            raise ValueError(f"gather must be 'last', 'all' or None, got {gather!r}")
        batch = BatchInputs(
            input_ids=torch.tensor([ids], dtype=torch.long),
            position_ids=torch.tensor([positions], dtype=torch.long),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            input_pos=torch.tensor([r.input_pos for r in reqs], dtype=torch.int32),
            page_table=torch.tensor(rows, dtype=torch.int32),
            slot_idx=torch.tensor([r.slot for r in reqs], dtype=torch.int32) if slots else None,
            logits_idx=None if logits_idx is None else torch.tensor(logits_idx, dtype=torch.long),
        )
        if torch.device(device).type != "cpu":
            for f in fields(batch):
                value = getattr(batch, f.name)
                if value is not None:
                    setattr(batch, f.name, value.to(device, non_blocking=True))
        return batch


    def _decode_batch(self, reqs: list[SequenceRequest], gathers: bool, slots: bool, min_width: int) -> BatchInputs:
        width = max(min_width, *(self.pages_needed(r.input_pos + 1) for r in reqs))
        key = (len(reqs), width, gathers, slots)
        inputs = self._decode_inputs.get(key)
        if inputs is None:
            inputs = self._decode_inputs[key] = _DecodeInputs(len(reqs), width, self.page_size, gathers, slots)
        self._last_decode = inputs
        return inputs.fill(reqs)

    def advance(self, token_ids: Sequence[int]) -> BatchInputs | None:
        """The next decode step of the sequences of the last ``build(reuse=True)`` decode batch: sequence i's
        one new token is ``token_ids[i]``, at the position after its last one; its pages are unchanged. The same
        tensors as that batch, written in place (the scheduler's multi-step decode, without building the batch
        again). None, and nothing written, where the last batch built was not such a decode batch or its page table
        is too narrow for the new positions: the caller builds that step in full."""
        inputs = self._last_decode
        return inputs.batch if inputs is not None and inputs.advance(token_ids) else None

    def decode_capacity(self) -> int | None:
        """Positions the page table of the last ``build(reuse=True)`` decode batch covers (a step that writes a
        position at or past it needs a wider table); None where the last batch built was not such a batch."""
        return self._last_decode.capacity if self._last_decode is not None else None


class _DecodeInputs:
    """The tensors of decode batches of one shape (one token per sequence), kept and refilled through numpy
    views of them: the constant ones (``seq_lens``, ``logits_idx``) are written once."""

    def __init__(self, num_seqs: int, width: int, page_size: int, gathers: bool, slots: bool):
        self.width = width
        self.capacity = width * page_size  # tokens the page table's columns cover
        self.batch = BatchInputs(
            input_ids=torch.zeros(1, num_seqs, dtype=torch.long),
            position_ids=torch.zeros(1, num_seqs, dtype=torch.long),
            seq_lens=torch.ones(num_seqs, dtype=torch.int32),
            input_pos=torch.zeros(num_seqs, dtype=torch.int32),
            page_table=torch.zeros(num_seqs, width, dtype=torch.int32),
            slot_idx=torch.zeros(num_seqs, dtype=torch.int32) if slots else None,
            logits_idx=torch.arange(num_seqs, dtype=torch.long) if gathers else None,
        )
        self._ids, self._positions = self.batch.input_ids.numpy()[0], self.batch.position_ids.numpy()[0]
        self._input_pos, self._table = self.batch.input_pos.numpy(), self.batch.page_table.numpy()
        self._slots = self.batch.slot_idx.numpy() if slots else None

    def fill(self, reqs: list[SequenceRequest]) -> BatchInputs:
        for i, r in enumerate(reqs):
            self._ids[i] = r.token_ids[0]
            self._positions[i] = self._input_pos[i] = r.input_pos
            pages = r.pages[: self.width]
            self._table[i, : len(pages)] = pages
            self._table[i, len(pages):] = 0
            if self._slots is not None:
                self._slots[i] = r.slot
        return self.batch

    def advance(self, token_ids: Sequence[int]) -> bool:
        """Each sequence one token on (``token_ids[i]`` at the next position); False where a new position would
        fall past the page table's columns (nothing is written then)."""
        if self._positions.max() + 1 >= self.capacity:
            return False
        self._ids[:] = token_ids
        self._positions += 1
        self._input_pos += 1
        return True


class PagePool:
    """Free list of the cache's pages: ``allocate(n)`` hands out pages, ``free(pages)`` takes them back.

    Freed pages are reused as they are: the cached op overwrites a slot before any query can see it,
    so stale data needs no clearing.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV-cache pages: {n} requested, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated")
            self._used.remove(p)
            self._free.append(p)

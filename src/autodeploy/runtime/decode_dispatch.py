"""The module the ``torch-compile`` backend serves: decode-only batches through the decode graph, every
other batch through the general (cached) graph.

Both graphs get at least two page-table columns, and the general graph at least two sequences and two
gathered logits rows: Dynamo specializes dimensions of size 1, so padding them keeps one compiled graph for
every length and batch size (the extra sequence is empty, cached attention skips it; the repeated logits
row is dropped again).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .sequence_info import LOGITS_IDX, SLOT_IDX


class DecodeDispatch(nn.Module):
    """Serves decode-only batches with the (compiled) decode graph and every other batch with the cached
    graph (``general``), which keeps the KV-cache metadata the runtime reads."""

    #: page-table columns both graphs get (narrower tables are padded; callers may build them this wide)
    min_table_width = 2

    def __init__(self, general: nn.Module, decode: nn.Module, input_names: list[str],
                 decode_inductor_config: dict | None = None):
        super().__init__()
        self.general, self.decode = general, decode
        # Inductor settings for the multi-sequence decode graph (freezing). Dynamo reads them from the global
        # config while tracing, so they are set around each call that may compile, not passed as options
        self._decode_config = decode_inductor_config or {}
        self._names = list(input_names)
        self._ids, self._seq_lens = input_names.index("input_ids"), input_names.index("seq_lens")
        self._page_table = input_names.index("page_table")
        self._input_pos = input_names.index("input_pos")
        self._logits_idx = input_names.index(LOGITS_IDX) if LOGITS_IDX in input_names else None
        self._slot_idx = input_names.index(SLOT_IDX) if SLOT_IDX in input_names else None

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor):
        if kwargs:  # the graph's inputs by name (``gm(**batch.as_kwargs())``), in placeholder order
            unknown = set(kwargs) - set(self._names[len(args):])
            if unknown:
                raise TypeError(f"unexpected or repeated graph input(s) {sorted(unknown)}; inputs: {self._names}")
            args = args + tuple(kwargs[name] for name in self._names[len(args):] if name in kwargs)
        args = list(args)
        table = args[self._page_table]
        # a second column (unused: pages are looked up by position, or masked) keeps the width dynamic:
        # Dynamo specializes a width of 1, so one-page prompts would compile a graph of their own
        if table.shape[1] < self.min_table_width:
            args[self._page_table] = F.pad(table, (0, self.min_table_width - table.shape[1]))
        # as many tokens as sequences means one token each: the runtime never sends a sequence without one
        if args[self._ids].shape[-1] != args[self._seq_lens].shape[0]:
            return self._run_general(args)
        if not self._decode_config or table.shape[0] == 1:  # batch 1 is its own graph; it gains nothing
            return self.decode(*args)
        import torch._inductor.config as inductor_config  # here: a served package never imports the compiler

        with inductor_config.patch(self._decode_config):
            return self.decode(*args)

    def _run_general(self, args: list[torch.Tensor]):
        """The general graph, with at least two sequences and two gathered logits: Dynamo specializes a
        dimension of size 1, so one-sequence prompts would compile a graph of their own (and tracing without
        that specialization gives a slower graph). The extra sequence is empty (no tokens:
        cached attention skips it); the repeated logits row is dropped again."""
        if args[self._seq_lens].shape[0] == 1:
            args[self._seq_lens] = F.pad(args[self._seq_lens], (0, 1))
            args[self._input_pos] = F.pad(args[self._input_pos], (0, 1))
            args[self._page_table] = F.pad(args[self._page_table], (0, 0, 0, 1))
            if self._slot_idx is not None:  # the empty sequence leaves its slot alone
                args[self._slot_idx] = F.pad(args[self._slot_idx], (0, 1))
        if self._logits_idx is None or args[self._logits_idx].shape[0] != 1:
            return self.general(*args)
        args[self._logits_idx] = args[self._logits_idx].repeat(2)
        logits, *rest = self.general(*args)
        return (logits[:, :1], *rest)

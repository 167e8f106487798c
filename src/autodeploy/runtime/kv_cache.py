"""The paged KV cache of a cached graph: its description, sizing and allocation.

``insert_cached_attention`` records a :class:`KVCacheSpec` in ``gm.meta["kv_cache"]`` (and in the
pipeline context's ``extras["kv_cache"]``): one :class:`CacheLayer` per attention node, each with a k and
a v cache registered on the graph module as non-persistent buffers (read by ``get_attr`` nodes, so the
graph's callers never pass them). Each cache is [num_pages, page_size, n_kv_heads, head_dim].
``initialize_cache`` / ``resize_kv_cache`` allocate them with :func:`allocate_kv_caches`, which refuses to
go over a byte budget.

Beside the pages, the spec holds the state cache of state-space layers (``insert_cached_ssm``): one
:class:`StateLayer` per cached state-space op, a buffer of [max_batch_size, *shape] on the graph module, one
slot per running sequence (the runtime hands a sequence its slot at admission, the graph input ``slot_idx``).
Its size does not depend on the number of pages; it is allocated (zero-filled) together with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import AutoDeployError
from ..utils.memory import available_memory_bytes  # noqa: F401  (part of this module's interface)

KV_CACHE_META_KEY = "kv_cache"


@dataclass
class CacheLayer:
    """The k/v caches of one attention node (buffer names on the graph module and per-token shape)."""

    k_name: str
    v_name: str
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.n_kv_heads * (self.head_dim + self.v_head_dim) * itemsize


@dataclass
class StateLayer:
    """The state cache of one cached state-space op: buffer ``name`` of [num_slots, *shape] on the graph module."""

    name: str
    shape: tuple[int, ...]  # of one sequence's state
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class KVCacheSpec:
    """Everything the runtime needs to know about the graph's KV cache."""

    backend: str
    page_size: int
    max_batch_size: int
    max_seq_len: int
    layers: list[CacheLayer] = field(default_factory=list)
    state_layers: list[StateLayer] = field(default_factory=list)  # one slot per sequence (max_batch_size)
    num_pages: int = 0  # currently allocated; 0 while the caches are meta placeholders
    device: str = "meta"

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def max_useful_pages(self) -> int:
        """Pages for ``max_batch_size`` sequences of ``max_seq_len`` tokens: more can never be used."""
        return self.max_batch_size * self.max_pages_per_seq

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.bytes_per_token

    @property
    def state_nbytes(self) -> int:
        """Bytes of the state cache (every slot of every state layer), whatever the number of pages."""
        return self.max_batch_size * sum(layer.bytes_per_slot for layer in self.state_layers)

    def nbytes(self, num_pages: int | None = None) -> int:
        """Bytes of the caches with ``num_pages`` pages (default: as allocated now; nothing while unallocated)."""
        if num_pages is None:
            return self.num_pages * self.bytes_per_page + (self.state_nbytes if self.num_pages else 0)
        return num_pages * self.bytes_per_page + self.state_nbytes

    @property
    def max_tokens(self) -> int:
        """Tokens the allocated cache holds (over all sequences)."""
        return self.num_pages * self.page_size


def cache_tensors(gm: nn.Module, spec: KVCacheSpec) -> list[torch.Tensor]:
    return ([getattr(gm, name) for layer in spec.layers for name in (layer.k_name, layer.v_name)]
            + [getattr(gm, layer.name) for layer in spec.state_layers])


def allocate_kv_caches(
    gm: nn.Module,
    spec: KVCacheSpec,
    num_pages: int,
    device: torch.device | str,
    budget_bytes: int | None = None,
) -> None:
    """(Re)allocate every cache of ``spec`` on ``gm`` with ``num_pages`` pages, zero-filled (and the state
    cache, one slot per sequence).

    The old caches are released first, so the peak is the larger of the old and the new size, not
    their sum. Raises (allocating nothing) when the new caches would exceed ``budget_bytes``.
    """
    if num_pages < 1:
        raise AutoDeployError(f"the KV cache needs at least one page, got num_pages={num_pages}")
    needed = spec.nbytes(num_pages)
    if budget_bytes is not None and needed > budget_bytes:
        raise AutoDeployError(
            f"a KV cache of {num_pages} pages needs {needed} bytes, over its budget of {budget_bytes} bytes"
        )
    device = torch.device(device)
    for layer in spec.layers:  # release first
        for name in (layer.k_name, layer.v_name):
            old = getattr(gm, name)
            gm.register_buffer(name, torch.empty(0, *old.shape[1:], dtype=old.dtype, device="meta"), persistent=False)
    for state in spec.state_layers:
        gm.register_buffer(state.name, torch.empty(0, *state.shape, dtype=state.dtype, device="meta"), persistent=False)
    for layer in spec.layers:
        for name, dim in ((layer.k_name, layer.head_dim), (layer.v_name, layer.v_head_dim)):
            shape = (num_pages, spec.page_size, layer.n_kv_heads, dim)
            gm.register_buffer(name, torch.zeros(shape, dtype=layer.dtype, device=device), persistent=False)
    for state in spec.state_layers:
        shape = (spec.max_batch_size, *state.shape)
        gm.register_buffer(state.name, torch.zeros(shape, dtype=state.dtype, device=device), persistent=False)
    spec.num_pages = num_pages
    spec.device = str(device)

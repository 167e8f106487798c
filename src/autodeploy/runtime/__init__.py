"""The runtime side of the cached graph: sequence interface (per-forward inputs) and KV-cache manager."""

from .kv_cache import CacheLayer, KVCacheSpec, allocate_kv_caches, available_memory_bytes  # noqa: F401
from .sequence_info import BatchInputs, PagePool, SequenceInfo, SequenceRequest, last_token_idx  # noqa: F401

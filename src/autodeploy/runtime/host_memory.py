"""The serving process keeps the memory it frees, so that a step's activations reuse pages already mapped.

By default glibc serves a large allocation (from 128 KiB, a threshold it raises as blocks are freed, up to
32 MiB) with a fresh ``mmap`` and hands it back on ``free``, and it returns free memory at the top of its heap
to the system past a trim threshold. A prefill's activations are that size (a batch of 16 prompts of 128
tokens: 16-32 MB per product of the 125M Llama), so every step faulted its pages in again, each one zeroed by
the kernel: 150-195 thousand page faults per batch-16 prefill, 25-35 % of its time on the AMD EPYC of
docs/performance.md. :func:`keep_freed_memory` sets the largest mmap threshold glibc accepts and a trim
threshold of 1 GiB, which brings those faults to under 300 (docs/performance.md, "Issue 18, eleventh round").

The setting is process-wide (it changes how glibc's ``malloc`` serves every caller), and freed memory up to
the trim threshold stays with the process: its peak is unchanged, but its resident size no longer falls after a
large step. ``AUTODEPLOY_KEEP_FREED_MEMORY=0`` leaves glibc's defaults. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import os

from ..utils.logger import ad_logger

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: the largest mmap threshold glibc's mallopt accepts on 64-bit systems (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**30

#: ``0`` leaves glibc's thresholds as they are
KEEP_FREED_MEMORY_ENV = "AUTODEPLOY_KEEP_FREED_MEMORY"

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once); True where they are set."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") == "0":
        return False
    try:
        process = ctypes.CDLL(None)  # the symbols the process has loaded, its C library's among them
    except (OSError, TypeError):  # no such handle (Windows)
        return False
    if not hasattr(process, "gnu_get_libc_version"):  # not glibc: its allocator has its own policy
        return False
    _applied = (bool(process.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
                and bool(process.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    ad_logger.debug(f"host memory: glibc mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
                    f"{TRIM_THRESHOLD >> 20} MiB: {'set' if _applied else 'refused'}")
    return _applied

"""Memory readings used to check that transforms change memory only when they are expected to."""

from __future__ import annotations

import bisect
import ctypes
import os
import resource
from typing import Iterable

import torch

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_memory_bytes() -> int:
    """CUDA allocated bytes when a GPU is in use, else this process's resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.memory_allocated()
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except OSError:  # not Linux: fall back to the peak, which still grows with real allocations
        return peak_rss_bytes()


def _proc_field_bytes(path: str, field: str) -> int | None:
    """A ``Field:   123 kB`` line of a /proc file, in bytes (None where there is no /proc)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far: VmHWM (per address space, so a spawned child
    reports its own peak; ``ru_maxrss`` would carry the parent's over fork+exec), else ru_maxrss."""
    peak = _proc_field_bytes("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory on ``device``: ``cudaMemGetInfo`` free bytes on a GPU, ``MemAvailable`` on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = _proc_field_bytes("/proc/meminfo", "MemAvailable")
    return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * _PAGE_SIZE


def format_bytes(n: int | float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.1f} {unit}" if unit != "B" else f"{sign}{int(n)} B"
        n /= 1024
    return f"{sign}{n:.1f} GiB"


_MADV_DONTNEED = 4


def file_mapped_ranges() -> list[tuple[int, int]]:
    """[start, end) address ranges of this process's private file mappings (memory-mapped checkpoints
    among them); empty where there is no /proc."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                # address perms offset dev inode path: a private mapping ("p") of a file (inode != 0)
                if len(fields) >= 6 and fields[1].endswith("p") and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        pass
    return ranges


class FilePageReleaser:
    """Drops the resident pages of tensors that lie in a memory-mapped file once they are replaced.

    A memory-mapped checkpoint stays resident page by page as its tensors are read; a transform that
    replaces each weight by a smaller one (``quantize_weights``) would otherwise hold the whole file
    resident until the last weight goes. :meth:`release` gives back the whole pages that lie inside one
    tensor and inside a private file mapping, with ``madvise(MADV_DONTNEED)``: untouched by any other
    tensor of ``tensors``, read again from the file if ever touched (the file is never written). Linux only;
    elsewhere it releases nothing."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self._maps = file_mapped_ranges()
        spans = sorted({(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors
                        if t.device.type == "cpu" and t.numel()})
        self._starts, self._spans = [a for a, _ in spans], spans
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise if self._maps else None

    def _shared(self, lo: int, hi: int, own: tuple[int, int]) -> bool:
        """Whether another tensor's bytes overlap [lo, hi)."""
        return any(span != own and span[1] > lo for span in self._spans[:bisect.bisect_left(self._starts, hi)])

    def release(self, tensor: torch.Tensor) -> int:
        """Drop ``tensor``'s whole pages (the caller is about to delete it); returns the bytes released."""
        if self._madvise is None or tensor.device.type != "cpu":
            return 0
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(a <= start and end <= b for a, b in self._maps):
            return 0
        lo, hi = -(-start // _PAGE_SIZE) * _PAGE_SIZE, end // _PAGE_SIZE * _PAGE_SIZE
        if hi <= lo or self._shared(lo, hi, (start, end)):
            return 0
        if self._madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
            return 0
        return hi - lo

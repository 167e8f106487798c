"""Memory readings used to check that transforms change memory only when they are expected to."""

from __future__ import annotations

import os
import resource

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

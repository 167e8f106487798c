"""Memory readings used to check that transforms change memory only when they are expected to, and the
page-level hints and clean-ups that keep a build's resident memory near its weights'."""

from __future__ import annotations

import bisect
import ctypes
import linecache
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


_MADV_RANDOM = 1
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_POPULATE_READ = 22
_HUGE_PAGE = 2 << 20


def _libc_madvise():
    """libc's ``madvise`` (errno kept), or None where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) addresses of the bytes ``tensor`` reads (a contiguous tensor's, or a view's first to last)."""
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _private_file_areas() -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of this process's private file mappings, areas of one file that
    continue each other (a mapping ``madvise`` split) joined; empty where there is no /proc."""
    areas: list[tuple[int, int, int, str]] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[1].endswith("p") or fields[4] == "0":
                    continue
                path = fields[5].rstrip("\n")
                if not path.startswith("/"):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                offset = int(fields[2], 16)
                if areas and areas[-1][1] == start and areas[-1][3] == path and \
                        areas[-1][2] + (start - areas[-1][0]) == offset:
                    areas[-1] = (areas[-1][0], end, areas[-1][2], path)
                else:
                    areas.append((start, end, offset, path))
    except OSError:
        pass
    return areas


def file_mapped_ranges() -> list[tuple[int, int]]:
    """[start, end) address ranges of this process's private file mappings (memory-mapped checkpoints
    among them); empty where there is no /proc. A mapping that ``madvise`` split into several areas (see
    :func:`advise_random_access`) is one range again, so a tensor across a split still lies inside one."""
    ranges: list[tuple[int, int]] = []
    last_path = None
    for start, end, _, path in _private_file_areas():
        if ranges and ranges[-1][1] == start and path == last_path:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
        last_path = path
    return ranges


def mapped_file_locations(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, int]]:
    """For each CPU tensor of ``tensors`` whose bytes lie in a private file mapping (a memory-mapped
    checkpoint's), the file and the offset of its first byte there: ``{name: (path, offset)}``."""
    areas = _private_file_areas()
    starts = [a[0] for a in areas]
    found = {}
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.numel() or not t.is_contiguous():
            continue
        ptr, end = _byte_span(t)
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and end <= areas[i][1]:
            start, _, offset, path = areas[i]
            found[name] = (path, offset + ptr - start)
    return found


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
        spans = sorted({_byte_span(t) for t in tensors
                        if t.device.type == "cpu" and t.numel()})
        self._starts, self._spans = [a for a, _ in spans], spans
        self._madvise = _libc_madvise() if self._maps else None

    def _shared(self, lo: int, hi: int, own: tuple[int, int]) -> bool:
        """Whether another tensor's bytes overlap [lo, hi)."""
        return any(span != own and span[1] > lo for span in self._spans[:bisect.bisect_left(self._starts, hi)])

    def release(self, tensor: torch.Tensor) -> int:
        """Drop ``tensor``'s whole pages (the caller is about to delete it); returns the bytes released."""
        if self._madvise is None or tensor.device.type != "cpu":
            return 0
        start, end = _byte_span(tensor)
        if not any(a <= start and end <= b for a, b in self._maps):
            return 0
        lo, hi = -(-start // _PAGE_SIZE) * _PAGE_SIZE, end // _PAGE_SIZE * _PAGE_SIZE
        if hi <= lo or self._shared(lo, hi, (start, end)):
            return 0
        if self._madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
            return 0
        return hi - lo


def advise_random_access(tensor: torch.Tensor) -> bool:
    """Tell the kernel that ``tensor``, where it lies in a file mapping, is read row by row at random
    (``madvise(MADV_RANDOM)``): a page fault then maps that page, not the read-ahead window around it.

    An embedding table is read a few rows per token. Without the hint, the first touch of a row read from
    disk maps the read-ahead window around it: 64 rows spread over a 64 MiB table mapped 27 MiB, against
    none with it (tests/utils/test_memory.py). Pages the page cache already holds in large folios are mapped
    whole either way (docs/performance.md). Returns whether the hint was given (Linux, a file-mapped CPU
    tensor)."""
    if tensor.device.type != "cpu" or not tensor.numel():
        return False
    start, end = _byte_span(tensor)
    if not any(a <= start and end <= b for a, b in file_mapped_ranges()):
        return False
    madvise = _libc_madvise()
    lo = start // _PAGE_SIZE * _PAGE_SIZE  # madvise wants a page-aligned start; a hint may cover neighbours
    return madvise is not None and madvise(ctypes.c_void_p(lo), ctypes.c_size_t(end - lo), _MADV_RANDOM) == 0


def map_in_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Map the memory of ``tensors`` (weights a decode step reads whole) with 2 MiB pages where the kernel can,
    and read it in now: ``madvise(MADV_HUGEPAGE)`` over the pages they lie on, then ``MADV_POPULATE_READ`` over
    them in address order. Returns the bytes hinted (0 off Linux, or where the kernel refuses the hint).

    A decode step reads every weight once: 400 MB of float32 weights in 4 KiB pages are some 100 000 TLB misses
    a step. Pages of a file mapping read after the hint come into the page cache as 2 MiB folios, each mapped by
    one page-table entry: the 125M Llama's decode step ran 1.02-1.13x faster in float32 and 1.05x in int8, the
    16-bit and 4-bit ones 1.00-1.03x (Zen 4, docs/performance.md). They must be read by one stream: the decode
    step's two threads reading their halves of each weight left most of the file in smaller folios, so the pages
    are read here, in order. Where the page cache already holds the file in smaller pieces (a file read or
    written before), they stay as they are: a package's weights are read from disk by the process that serves
    them (the build drops the written file's pages). Not for tensors read a few rows at a time (embedding tables:
    :func:`advise_random_access`), whose first touch would map 2 MiB; nor runs of tensors under 2 MiB in all (a
    checkpoint's norms between its unused weights); and the pages are read only where they fit in the available
    memory."""
    madvise = _libc_madvise()
    if madvise is None:
        return 0
    ranges: list[list[int]] = []
    # whole pages, neighbours' edges included, so that the ranges of tensors side by side join into one area
    # and a 2 MiB page can span their boundaries
    spans = sorted(_byte_span(t) for t in tensors if t.device.type == "cpu" and t.numel())
    for lo, hi in ((start // _PAGE_SIZE * _PAGE_SIZE, -(-end // _PAGE_SIZE) * _PAGE_SIZE) for start, end in spans):
        if ranges and lo <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], hi)
        else:
            ranges.append([lo, hi])
    # a range under 2 MiB holds no huge page, and its hint would make a cold file's fault read 2 MiB around it
    hinted = [(lo, hi) for lo, hi in ranges if hi - lo >= _HUGE_PAGE
              and madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) == 0]
    total = sum(hi - lo for lo, hi in hinted)
    if total and total < available_memory_bytes("cpu"):
        for lo, hi in hinted:  # fails harmlessly before Linux 5.14: the steps then read the pages
            madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_POPULATE_READ)
    return total


def read_into_memory(tensor: torch.Tensor, chunk_bytes: int = 8 << 20) -> torch.Tensor:
    """A copy of ``tensor`` in the process's own memory, read a chunk of about ``chunk_bytes`` at a time along
    its first dimension. Where ``tensor`` lies in a private file mapping, each chunk's whole pages are dropped
    once copied (:class:`FilePageReleaser`), so resident memory grows by the copy and a chunk, not twice the
    tensor; the file is never written."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    if tensor.dim() == 0 or tensor.numel() == 0:
        return out.copy_(tensor)
    releaser = FilePageReleaser(())  # the chunks are slices of one tensor: none shares another's pages
    step = max(1, chunk_bytes // max(1, tensor[0].numel() * tensor.element_size()))
    for start in range(0, tensor.shape[0], step):
        out[start:start + step].copy_(tensor[start:start + step])
        releaser.release(tensor[start:start + step])
    return out


def release_trace_caches(mod: torch.nn.Module) -> None:
    """Give back what tracing left behind before the weights make memory grow: the source lines cached for
    tracebacks (``linecache``: the model's and torch's files read for each node's stack trace), the
    generated source of every GraphModule that is not one of ``mod``'s (torch.fx keeps each recompile's
    source for the life of the process: hundreds of copies of a model's forward after a pipeline), then
    glibc's ``malloc_trim``, so the freed pages leave the process or serve what comes next (strings, freed
    as their last reference goes: no collection needed).
    Before the weights load and before compiling, it lowered the 125M model's peak RSS by 5-10 MiB
    (docs/performance.md)."""
    linecache.clearcache()
    from torch.fx import GraphModule, graph_module

    sources = getattr(getattr(graph_module, "_loader", None), "eval_cache", None)
    if isinstance(sources, dict):
        live = {type(m).forward.__code__.co_filename for m in mod.modules() if isinstance(m, GraphModule)}
        for key in [k for k in sources if k not in live]:
            del sources[key]
    try:  # what was freed goes back to the system, not kept in the allocator's free lists
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def drop_cached_pages(paths: Iterable[str | os.PathLike]) -> int:
    """Drop the page cache of the files ``paths`` (written back first, then ``posix_fadvise(DONTNEED)``), so
    the next process to map them reads them from disk. Pages that a process has mapped stay. Returns how
    many files were dropped (none where ``posix_fadvise`` is missing).

    What a process maps on a fault depends on what the page cache already holds: a file read or written
    in large pieces sits there in large folios, mapped whole, so one process's leftovers changed another's
    resident memory (HF's peak RSS moved by 90 MiB, its embedding table, between runs of the same bench:
    docs/performance.md). ``autodeploy bench`` drops the checkpoint before each side builds."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    dropped = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        finally:
            os.close(fd)
    return dropped

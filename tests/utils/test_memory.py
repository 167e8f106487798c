"""FilePageReleaser: the resident pages of a tensor in a private file mapping are given back, its data
(and every other tensor's) reads the same afterwards, and nothing outside file mappings is touched.
advise_random_access marks a mapped tensor's pages as read at random; read_into_memory copies a mapped tensor into
the process's memory, giving back the file's pages chunk by chunk; release_trace_caches drops the
sources of dead GraphModules and keeps the live ones'; drop_cached_pages empties a file's page cache;
map_in_huge_pages hints a mapped file's tensors for 2 MiB pages and reads them in, in 2 MiB pages where the
kernel and the file system can."""

import linecache
import os
import sys

import numpy as np
import pytest
import torch

from autodeploy.utils.memory import (
    FilePageReleaser,
    advise_random_access,
    drop_cached_pages,
    map_in_huge_pages,
    read_into_memory,
    release_trace_caches,
)
from proc_maps import smaps_entry, vm_flags

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")

PAGE = 4096


def _rss_file_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile line")


def _mapped(tmp_path, values: np.ndarray) -> torch.Tensor:
    """``values`` as a tensor over a private (copy-on-write) mapping of a file, like a memory-mapped
    checkpoint."""
    path = tmp_path / "weights.bin"
    values.tofile(path)
    return torch.from_numpy(np.memmap(path, dtype=values.dtype, mode="c", shape=values.shape))


def test_releases_the_pages_of_a_mapped_tensor_and_keeps_its_data(tmp_path):
    values = np.random.default_rng(0).standard_normal(4 * 2**20 // 4).astype(np.float32)  # 4 MiB
    whole = _mapped(tmp_path, values)
    first, second = whole[: len(values) // 2], whole[len(values) // 2 :]  # two weights side by side
    assert float(whole.sum()) != 0  # read: the pages are resident
    resident = _rss_file_bytes()
    released = FilePageReleaser([first, second]).release(first)
    assert 2 * 2**20 - 2 * PAGE <= released <= 2 * 2**20
    assert _rss_file_bytes() <= resident - released + 64 * PAGE  # other files may page in meanwhile
    # nothing changed: the dropped pages read again from the file, the neighbour was not touched
    assert np.array_equal(first.numpy(), values[: len(values) // 2])
    assert np.array_equal(second.numpy(), values[len(values) // 2 :])


def test_leaves_anonymous_and_shared_memory_alone(tmp_path):
    anonymous = torch.randn(2**20)
    assert FilePageReleaser([anonymous]).release(anonymous) == 0
    assert torch.isfinite(anonymous).all() and anonymous.abs().sum() > 0

    values = np.arange(2**20, dtype=np.float32)
    weight = _mapped(tmp_path, values)
    alias = weight[PAGE:]  # another tensor reading the same bytes
    assert FilePageReleaser([weight, alias]).release(weight) == 0
    assert FilePageReleaser([weight]).release(weight[:10]) == 0  # less than a whole page
    assert np.array_equal(weight.numpy(), values)


def test_random_access_hint_marks_only_the_mapped_tensor(tmp_path):
    table = _mapped(tmp_path, np.zeros((4096, 256), dtype=np.float32))  # 4 MiB, like an embedding table
    assert "rr" not in vm_flags(table.data_ptr())
    assert advise_random_access(table)
    assert "rr" in vm_flags(table.data_ptr())
    assert "rr" in vm_flags(table.data_ptr() + table.numel() * 4 - 1)
    # the neighbour that shares the table's last page still lies in one mapping for FilePageReleaser
    (tmp_path / "pair").mkdir()
    whole = _mapped(tmp_path / "pair", np.ones(3 * 2**20 + 100, dtype=np.float32))
    table, neighbour = whole[: 2**20 + 100], whole[2**20 + 100 :]
    assert advise_random_access(table)
    assert FilePageReleaser([table, neighbour]).release(neighbour) >= 2 * 2**20 * 4 - PAGE
    anonymous = torch.zeros(2**20)
    assert not advise_random_access(anonymous)
    assert "rr" not in vm_flags(anonymous.data_ptr())


def test_random_rows_of_a_cold_file_map_little(tmp_path):
    """Read from disk (the file's pages not in the page cache), 64 rows spread over a 64 MiB table map
    their own pages with the hint; without it each fault maps a read-ahead window (27 MiB here)."""
    rows, width = 16384, 1024  # 4 KiB rows
    path = tmp_path / "table.bin"
    np.ones((rows, width), dtype=np.float32).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: evicted from the page cache
    finally:
        os.close(fd)
    table = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c", shape=(rows, width)))
    assert advise_random_access(table)
    before = _rss_file_bytes()
    picked = torch.arange(0, rows, rows // 64)
    assert float(torch.nn.functional.embedding(picked, table).sum()) == 64 * width
    assert _rss_file_bytes() - before < 8 * 2**20


def test_read_into_memory_copies_a_mapped_table_and_gives_back_its_file_pages(tmp_path):
    values = np.random.default_rng(1).standard_normal((8192, 768)).astype(np.float32)  # 24 MiB, odd rows per page
    table = _mapped(tmp_path, values)
    (tmp_path / "warm").mkdir()
    read_into_memory(_mapped(tmp_path / "warm", values[:700]), chunk_bytes=2**20)  # torch's code paths paged in
    before = _rss_file_bytes()
    copy = read_into_memory(table, chunk_bytes=2**20)
    # every chunk's whole pages were given back (what stays: pages across two chunks, a huge page of the mapping)
    assert _rss_file_bytes() - before < 6 * 2**20
    assert np.array_equal(copy.numpy(), values) and copy.data_ptr() != table.data_ptr()
    assert not advise_random_access(copy)  # anonymous memory: not in a file mapping
    assert np.array_equal(table.numpy(), values)  # the mapping reads the same afterwards
    assert torch.equal(read_into_memory(torch.arange(5)), torch.arange(5))  # anonymous input: a plain copy


def test_release_trace_caches_keeps_only_the_live_graph_sources():
    from torch.fx import graph_module, symbolic_trace

    live = symbolic_trace(torch.nn.Linear(4, 4))
    dead = symbolic_trace(torch.nn.ReLU())
    live_key, dead_key = (type(m).forward.__code__.co_filename for m in (live, dead))
    del dead
    sources = graph_module._loader.eval_cache
    assert live_key in sources and dead_key in sources
    linecache.getlines(torch.__file__)
    release_trace_caches(live)
    assert live_key in sources and dead_key not in sources
    assert torch.__file__ not in linecache.cache
    x = torch.randn(2, 4)
    assert torch.equal(live(x), torch.nn.functional.linear(x, live.weight, live.bias))


def _cached_fraction(path) -> float:
    """The fraction of ``path``'s pages in the page cache: mincore over a fresh mapping (which faults nothing)."""
    import ctypes

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    pages = -(-mapped.size // PAGE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(mapped.ctypes.data), ctypes.c_size_t(mapped.size), vector) == 0
    del mapped
    return sum(v & 1 for v in vector) / pages


def _filesystem_type(path) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point above it, /proc/self/mounts)."""
    path, best, kind = os.path.realpath(path), "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mount, fstype = line.split()[:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def test_drop_cached_pages_empties_the_page_cache_of_a_file(tmp_path):
    if _filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a file in memory has no page cache to drop")
    path = tmp_path / "model.safetensors"
    np.ones(4 * 2**20 // 4, dtype=np.float32).tofile(path)  # just written: in the page cache
    assert _cached_fraction(path) > 0.9
    assert drop_cached_pages([path]) == 1
    assert _cached_fraction(path) < 0.1
    assert np.array_equal(np.fromfile(path, dtype=np.float32), np.ones(2**20, dtype=np.float32))


def _cold_file_tensors(tmp_path, sizes: list[int]) -> tuple[list[torch.Tensor], np.ndarray]:
    """Tensors of ``sizes`` float32 values side by side in a file whose pages are not in the page cache, and
    the values."""
    path = tmp_path / "weights.bin"
    values = np.random.default_rng(2).standard_normal(sum(sizes)).astype(np.float32)
    values.tofile(path)
    drop_cached_pages([path])
    whole = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c", shape=values.shape))
    return list(whole.split(sizes)), values


def test_map_in_huge_pages_hints_tensors_side_by_side_and_reads_them(tmp_path):
    # boundaries inside pages, as in a safetensors file
    tensors, values = _cold_file_tensors(tmp_path, [3 * 2**20 + 5, 2**20 + 17, 2**20 + 3])
    before = _rss_file_bytes()
    assert map_in_huge_pages(tensors[:2]) >= (4 * 2**20 + 22) * 4  # bytes hinted
    # one area: each end and the page the two share
    for address in (tensors[0].data_ptr(), tensors[1].data_ptr(), tensors[1][-1].data_ptr()):
        assert "hg" in vm_flags(address)
    assert "hg" not in vm_flags(tensors[2][-1].data_ptr())  # the third was not asked for
    assert _rss_file_bytes() - before >= (4 * 2**20) * 4 - 64 * PAGE  # read in, not left to the first step
    assert np.array_equal(torch.cat(tensors).numpy(), values)
    assert map_in_huge_pages([torch.zeros(0), torch.zeros(3, device="meta")]) == 0
    assert map_in_huge_pages([tensors[2][:1000]]) == 0  # under 2 MiB: no huge page to map
    assert "hg" not in vm_flags(tensors[2][-1].data_ptr())


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _file_system(path) -> str:
    best = ("", "")
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, kind = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, kind)
    return best[1]


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off")
def test_map_in_huge_pages_maps_a_cold_file_in_2mib_pages(tmp_path):
    """What the hint is for: the pages of a file read after it sit in 2 MiB folios, one page-table entry each
    (a file system that keeps large folios: ext4, xfs, btrfs)."""
    if _file_system(tmp_path) not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"{tmp_path} is on {_file_system(tmp_path)}, which may not keep 2 MiB folios")
    tensors, _ = _cold_file_tensors(tmp_path, [16 * 2**20])  # 64 MiB
    map_in_huge_pages(tensors)
    # all but the 2 MiB blocks at the ends, which the tensor shares
    assert int(smaps_entry(tensors[0].data_ptr())["FilePmdMapped"][0]) * 1024 >= 48 * 2**20

"""FilePageReleaser: the resident pages of a tensor in a private file mapping are given back, its data
(and every other tensor's) reads the same afterwards, and nothing outside file mappings is touched."""

import sys

import numpy as np
import pytest
import torch

from autodeploy.utils.memory import FilePageReleaser

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

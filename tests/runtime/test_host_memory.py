"""keep_freed_memory: a step's large activations reuse pages the process already has, instead of faulting
fresh zeroed pages in on every step; AUTODEPLOY_KEEP_FREED_MEMORY=0 leaves glibc's thresholds alone. Each case
runs in a process of its own, since the setting is process-wide."""

import os
import platform
import subprocess
import sys

import pytest

# two prefill-sized activations (16 MiB each) filled, freed and filled again: the page faults of the refills
# after the first two (the first ones map the pages the later ones may reuse)
_PROBE = """
import resource, torch
from autodeploy.runtime.host_memory import keep_freed_memory
applied = keep_freed_memory()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x, y = torch.ones(4 * 2**20), torch.ones(4 * 2**20)
    del x, y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, min(faults[2:]))
"""
# glibc's starting mmap threshold (128 KiB), held fixed: left to itself glibc raises it as blocks are freed, and
# whether this probe's refills then fault depends on the heap's layout, so without the setting they would fault
# in some runs and not in others. A prefill's many activations of mixed sizes faulted in every step (150-195
# thousand faults per batch-16 prefill, docs/performance.md); this fixed start stands for that here.
_GLIBC_START = "glibc.malloc.mmap_threshold=131072"


def _refill_faults(keep: str) -> tuple[bool, int]:
    env = {**os.environ, "AUTODEPLOY_KEEP_FREED_MEMORY": keep, "GLIBC_TUNABLES": _GLIBC_START}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True)
    applied, fewest = out.stdout.split()
    return applied == "True", int(fewest)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_a_freed_activation_is_reused_without_page_faults():
    applied, fewest = _refill_faults("1")
    assert applied
    assert fewest < 64  # a refill of 32 MiB maps 8192 pages of 4 KiB afresh (16 or more with huge pages)
    applied, fewest = _refill_faults("0")
    assert not applied
    assert fewest >= 16  # the check above can fail: without the setting every refill maps its pages afresh

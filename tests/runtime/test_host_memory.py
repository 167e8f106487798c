"""keep_freed_memory: a step's large activations reuse pages the process already has, instead of faulting
fresh zeroed pages in on every step; AUTODEPLOY_KEEP_FREED_MEMORY=0 leaves glibc's defaults. Each case runs in
a process of its own, since the setting is process-wide."""

import os
import platform
import subprocess
import sys

import pytest

# two prefill-sized activations (16 MiB each) filled, freed and filled again, five times: the page faults of the
# refills (glibc's defaults give the freed 32 MiB at the top of the heap back to the system every time)
_PROBE = """
import resource, sys, torch
from autodeploy.runtime.host_memory import keep_freed_memory
applied = keep_freed_memory()
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x, y = torch.ones(4 * 2**20), torch.ones(4 * 2**20)
    del x, y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, min(faults[1:]))
"""


def _refill_faults(keep: str) -> tuple[bool, int]:
    env = {**os.environ, "AUTODEPLOY_KEEP_FREED_MEMORY": keep}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_a_freed_activation_is_reused_without_page_faults():
    applied, faults = _refill_faults("1")
    assert applied
    assert faults < 64  # refilling 32 MiB faults 4096 pages without it (4 KiB pages; 8+ with 2 MiB huge pages)
    applied, default_faults = _refill_faults("0")
    assert not applied
    # the check above can fail: glibc's defaults map one of the two afresh on every refill
    assert default_faults >= 8 and default_faults > 10 * faults

"""Host memory tuning for CPU training: after `keep_freed_host_memory`, memory a step frees is
reused without page faults (counted with getrusage in a child process: the setting is per process).
The control pins glibc's starting mmap threshold (128 KiB, before glibc's own adaptation, which
depends on the process's history): there every freed 4 MiB block goes back to the OS and faults in
again, so the count does see faults when they happen."""

import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, resource, sys, torch
from meshlm.train.host_memory import M_MMAP_THRESHOLD, keep_freed_host_memory

def faults(cycles=5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(cycles):
        tensors = [torch.ones(1 << 20) for _ in range(24)]  # 24 x 4 MiB, every page touched
        del tensors
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "keep":
    applied = keep_freed_host_memory()
else:
    applied = ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1
faults(2)  # the heap grows to its working size
print(applied, faults())
"""

PAGES = 5 * 24 * (4 << 20) // 4096  # what the loop touches in all


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                         check=True)
    applied, faults = out.stdout.split()
    assert applied == "True"
    return int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_freed_memory_is_reused_without_page_faults():
    assert _faults("control") > PAGES // 2  # each block mapped, touched, unmapped: it all faults
    assert _faults("keep") < PAGES // 20

"""``keep_freed_memory``: freed memory stays mapped for the next step, also in a thread other than the main one
(a Ray actor with concurrency groups runs its steps on one), where glibc unmaps an arena's extra heap as soon as it
is empty. Each case runs in a fresh interpreter: malloc's settings are process-wide."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or ctypes.util.find_library("c") is None,
                                reason="glibc's mallopt")

# a thread holds 60 MiB (most of its arena's first 64 MiB heap), then allocates, touches and frees 20 MiB ten
# times: each needs a second heap; the minor page faults of the last eight are printed
SCRIPT = """
import ctypes, resource, sys, threading
from chimera.util.host_memory import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    keep_freed_memory()
else:  # the settings without the top pad
    libc.mallopt(-3, 32 * 2**20)
    libc.mallopt(-1, 2**30)
n, faults = 20 * 2**20, []
def work():
    held = [libc.malloc(n) for _ in range(3)]
    for p in held:
        ctypes.memset(p, 1, n)
    for i in range(10):
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
t = threading.Thread(target=work)
t.start()
t.join()
print(faults[-1] - faults[2])
"""


def _faults(mode: str) -> int:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=root, capture_output=True, text=True, timeout=60,
                         check=True, env={"PYTHONPATH": str(root), "PATH": ""})
    return int(out.stdout.strip())


def test_a_threads_freed_heap_stays_mapped_for_the_next_allocation():
    pages = 8 * 20 * 2**20 // 4096
    assert _faults("without-pad") > pages // 2  # the case is real: glibc unmaps and faults the heap every time
    assert _faults("keep") < pages // 100

"""Which cores a host's CPU workers compute on (``--cpu-affinity auto``).

Where a host's workers (times their torch threads) fill or oversubscribe its usable cores, each worker is pinned to
cores of its own, round robin in rank order: with four 1F1B workers on two cores, pipeline neighbours (which hand
each micro-batch to each other) then never share a core, where the kernel's wake-up placement often put the woken
receiver beside its sender. Up to 5 % shorter steps on the development machine (``bench/RESULTS.md``, issue 29,
fourteenth round). Workers that leave cores free are left to the kernel: two jobs on one host would otherwise pin
their workers to the same few cores.

    core_sets(usable_cores(), workers=4, threads=1)   # [{0}, {1}, {0}, {1}] on two cores
    pin_worker(local_index, workers=4, threads=1)      # this process on its set
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from pathlib import Path


def host_id() -> str:
    """This host's identity: its name and the kernel's boot id (two hosts may share a name, not a boot). The ranks
    that share it share shared memory (``chimera.util.shm``) and cores."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}|{boot}"


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), sorted; [] where the platform cannot say."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def core_sets(cores: Sequence[int], workers: int, threads: int) -> list[frozenset[int]] | None:
    """For ``workers`` workers of ``threads`` torch threads each on ``cores``: worker i's cores (``threads`` of
    them, round robin from i x threads), or None where the workers do not fill the cores (left to the kernel)."""
    n = len(cores)
    if n == 0 or workers * threads < n:
        return None
    return [frozenset(cores[(i * threads + j) % n] for j in range(min(threads, n))) for i in range(workers)]


def shared_cores(workers: int) -> tuple[int, ...]:
    """The core each of ``workers`` one-thread workers on this host is pinned to where some share a core (the
    simulator's ``Costs.cores``), else ``()``: a core each."""
    cores = usable_cores()
    sets = core_sets(cores, workers, 1)
    if sets is None or workers == len(cores):
        return ()
    return tuple(min(s) for s in sets)


def pin_worker(index: int, workers: int, threads: int) -> frozenset[int] | None:
    """Pin this process as worker ``index`` of ``workers`` on this host (``threads`` torch threads each); its cores,
    or None where the workers leave cores free (nothing pinned)."""
    sets = core_sets(usable_cores(), workers, threads)
    if sets is None:
        return None
    pin_process(sets[index])
    return sets[index]


def pin_process(cpus: frozenset[int]) -> None:
    """Pin every thread of this process (and the threads it starts later) to ``cpus`` (Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue

"""Communication profiles: p2p ping-pong and SUM allreduce between the ranks of a torch.distributed group.

:func:`comm_probe` is the worker side: every rank of an initialised group (gloo on CPU, NCCL on GPU) calls it.
:func:`fit_comm` turns the ranks' samples into a :class:`CommProfile` (``latency_s + bytes / bandwidth_Bps``,
least squares). :func:`measure_comm_local` runs it with processes on this machine; on a Ray cluster
``ray_launch.commprobe.measure_comm_ray`` runs it between the actual workers::

    comm = measure_comm_local(world=2)           # CommProfile(p2p=Link(...), allreduce={2: Link(...)}, ...)
    comm.p2p.time(4 * 2**20)                     # seconds for a 4 MiB message
"""

from __future__ import annotations

import tempfile
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from chimera.profile.format import CommProfile, Link, ProfileError
from chimera.profile.timing import evict_caches
from chimera.util.processes import LocalProcesses

#: message sizes in bytes: 1 KiB, 4 KiB, ..., 16 MiB
SIZES = tuple(1024 * 4**k for k in range(8))
Samples = list[tuple[int, float]]  # (bytes, seconds)


def comm_probe(rank: int, world: int, device: torch.device, sizes: Sequence[int] = SIZES, reps: int = 3,
               timeout_s: float = 60.0, p2p: str = "auto") -> dict[str, Any]:
    """Measure on this rank: one-way p2p times (half a ping-pong's round trip) with its neighbours ``rank ± 1``
    (pairs (0, 1), (2, 3), ... then (1, 2), (3, 4), ...; the lower rank of a pair times it) and SUM allreduce
    times over ranks ``0..n-1`` for n = 2..world (rank 0 times them). Call on every rank, in the same order.

    Returns ``{"p2p": [(bytes, s), ...], "allreduce": {n: [(bytes, s), ...]}}`` (empty where this rank timed
    nothing); one warm-up exchange per size is discarded. The p2p messages take the runtime's path: on CPU with
    ``p2p`` auto, shared memory between processes of one host (``chimera.util.shm``; channels sized to the largest
    of ``sizes``, as the runtime sizes them to its largest message), gloo between hosts.
    """
    from chimera.util.shm import ShmChannels

    out: dict[str, Any] = {"p2p": [], "allreduce": {}}
    pairs = [("probe", a, b) for i in range(world - 1) for a, b in ((i, i + 1), (i + 1, i))]
    # every rank: the same device; the channels take the largest size, as the runtime's take its largest message
    chans = ShmChannels.open(rank, pairs, device.type == "cpu" and p2p == "auto", dict.fromkeys(pairs, max(sizes)))
    for first in (0, 1):
        for a in range(first, world - 1, 2):
            if rank in (a, a + 1):
                out["p2p"] += _ping_pong(rank, a, a + 1, device, sizes, reps, timeout_s, chans)
        _sync(None, device, timeout_s)
    groups = {n: dist.new_group(list(range(n))) for n in range(2, world + 1)}  # every rank creates every group
    for n, group in groups.items():
        if rank < n:
            samples = _allreduce_times(group, device, sizes, reps, timeout_s)
            if rank == 0:
                out["allreduce"][n] = samples
    _sync(None, device, timeout_s)
    chans.close()
    return out


def _ping_pong(rank: int, a: int, b: int, device: torch.device, sizes: Sequence[int], reps: int,
               timeout_s: float, chans: Any) -> Samples:
    out = []
    peer = b if rank == a else a

    def send(buf: torch.Tensor) -> None:
        _wait(chans.post("probe", peer, True, buf) or dist.isend(buf, peer), device, timeout_s,
              f"p2p send to rank {peer}")

    def recv(buf: torch.Tensor) -> None:
        _wait(chans.post("probe", peer, False, buf) or dist.irecv(buf, peer), device, timeout_s,
              f"p2p receive from rank {peer}")

    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8, device=device)
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            if rank == a:
                send(buf)
                recv(buf)
            else:
                recv(buf)
                send(buf)
            if rank == a and rep > 0:
                out.append((size, (time.perf_counter() - t0) / 2))
    return out


def _allreduce_times(group: Any, device: torch.device, sizes: Sequence[int], reps: int, timeout_s: float
                     ) -> Samples:
    out = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        for rep in range(reps + 1):
            _sync(group, device, timeout_s)  # start together: time the allreduce, not the others' lateness
            t0 = time.perf_counter()
            _wait(dist.all_reduce(buf, group=group, async_op=True), device, timeout_s, "allreduce")
            if rep > 0:
                out.append((buf.numel() * 4, time.perf_counter() - t0))
    return out


def _sync(group: Any, device: torch.device, timeout_s: float) -> None:
    _wait(dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True), device, timeout_s, "sync")


def _wait(work: Any, device: torch.device, timeout_s: float, what: str) -> None:
    """Wait for ``work`` at most ``timeout_s`` (gloo: its own timeout; NCCL: poll its completion)."""
    if device.type != "cuda":
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise ProfileError(f"communication probe: {what} did not complete within {timeout_s:g} s "
                               f"[{str(e).splitlines()[0][:200]}]") from None
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise ProfileError(f"communication probe: {what} did not complete within {timeout_s:g} s")
        time.sleep(0.00002)
    work.wait()


def fit_link(samples: Samples) -> Link:
    """``latency_s + bytes / bandwidth_Bps`` fitted to the per-size medians by least squares of relative error
    (so the small messages pin the latency, the large ones the bandwidth). A non-positive intercept or slope
    (noise) falls back to the smallest message's time or the best measured bandwidth."""
    if not samples:
        raise ProfileError("no communication samples to fit")
    by_size: dict[int, list[float]] = {}
    for size, t in samples:
        by_size.setdefault(size, []).append(t)
    x = np.array(sorted(by_size), dtype=float)
    y = np.array([np.median(by_size[int(s)]) for s in x])
    if len(x) == 1:
        return Link(float(y[0]), 0.0)
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)
    latency = float(intercept) if intercept > 0 else float(y[0])
    bandwidth = 1.0 / float(slope) if slope > 0 else float(np.max(x / y))
    return Link(latency, bandwidth)


def fit_comm(results: Sequence[dict[str, Any]], backend: str, where: str) -> CommProfile:
    """A :class:`CommProfile` from every rank's :func:`comm_probe` result."""
    p2p = [s for r in results for s in r["p2p"]]
    allreduce: dict[int, Samples] = {}
    for r in results:
        for n, samples in r["allreduce"].items():
            allreduce.setdefault(int(n), []).extend(samples)
    return CommProfile(fit_link(p2p), {n: fit_link(s) for n, s in sorted(allreduce.items())}, backend, where)


def _local_main(rank: int, world: int, init: str, backend: str, sizes: Sequence[int], reps: int, timeout_s: float,
                out: Any) -> None:
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        out.put(("ok", rank, comm_probe(rank, world, device, sizes, reps, timeout_s)))
    except BaseException as e:  # reported to the parent
        out.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_comm_local(world: int = 2, backend: str = "gloo", *, sizes: Sequence[int] = SIZES, reps: int = 3,
                       timeout_s: float = 120.0) -> CommProfile:
    """Run :func:`comm_probe` in ``world`` processes on this machine (NCCL: one GPU per process)."""
    if world < 2:
        raise ProfileError(f"a communication probe needs at least 2 processes, got {world}")
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        args = [(r, world, f"file://{tmp}/rendezvous", backend, tuple(sizes), reps, timeout_s) for r in range(world)]
        with LocalProcesses(_local_main, args, ProfileError, "communication probe process") as procs:
            waiting = lambda: f"processes {sorted(set(range(world)) - set(results))}"  # noqa: E731
            for kind, rank, payload in procs.messages(timeout_s + 60, waiting):
                if kind == "error":
                    raise ProfileError(f"communication probe: process {rank} failed: {payload}")
                results[rank] = payload
                if len(results) == world:
                    procs.finished = True
                    break
    return fit_comm([results[r] for r in range(world)], backend, f"local {backend}, {world} processes")


def measure_host_links(device: str = "cpu", sizes: Sequence[int] = (2**16, 2**20, 2**22, 2**24), reps: int = 3
                       ) -> tuple[Link, Link]:
    """Host -> device and device -> host copy time (``latency + bytes / bandwidth``), as offload's swaps copy:
    from pinned host memory on GPU; on CPU a copy into a distinct tensor (the host store's "device" copy, and
    the copy the gradient sums pack and unpack with), each from cold caches."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    into, out = [], []
    for size in sizes:
        host = torch.empty(size // 4, dtype=torch.float32)
        host = host.pin_memory() if cuda else host
        on_device = torch.empty_like(host, device=dev)
        for samples, dst, src in ((into, on_device, host), (out, host, on_device)):
            for _ in range(reps + 1):
                evict_caches(dev)  # as in training, where the copied tensors were not just touched
                t0 = time.perf_counter()
                dst.copy_(src)
                if cuda:
                    torch.cuda.synchronize(dev)
                samples.append((size, time.perf_counter() - t0))
            del samples[-reps - 1]  # the first copy warms up
    return fit_link(into), fit_link(out)

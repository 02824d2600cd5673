"""How the profiler takes a timing: lock-step pacing of concurrent profiling processes, repeated runs with median
and spread, and every timed run started with cold caches.

In a training step a layer's forward, backward and optimizer step each come after the work of the other layers,
which pushes this layer's weights, activations and optimizer state out of the cache. Timed back to back, a small
layer keeps them in the cache and runs faster than it will in training (measured on BERT-tiny at micro-batch 8,
one core: a transformer block's forward 1.4x, a layer's AdamW step 2.4x). :func:`evict_caches` writes a buffer
larger than the cache a worker gets before every timed run::

    from chimera.profile.timing import optimizer_costs
    state_bytes, seconds = optimizer_costs(torch.nn.Linear(512, 512))   # {"adamw": ..., ...} each
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from chimera.microbatch import tensors
from chimera.optim import OPTIMIZERS, build_optimizer
from chimera.profile.format import Timing

PACE_TIMEOUT_S = 600.0  # a lock-stepped peer that stops answering fails the profile instead of hanging it
#: bytes written to evict the host's caches: at least the last-level cache, at most this (the share of a big
#: shared last-level cache one core can hold is far smaller than the whole)
HOST_EVICT_MAX = 128 * 2**20
HOST_EVICT_MIN = 32 * 2**20


def _no_pace() -> None:
    pass


_pace: Callable[[], None] = _no_pace  # called right before every timed region; lock-steps concurrent profilers


def set_pace(pace: Callable[[], None]) -> None:
    """Call ``pace`` right before every timed region of this process (a barrier shared with concurrent profilers)."""
    global _pace
    _pace = pace


def pace() -> None:
    """The barrier of :func:`set_pace`: called last before a timed region starts (after its set-up and the cache
    eviction), so that concurrent profilers time the same moments and none times its run beside another's eviction."""
    _pace()


def measure(fn: Callable[[], float], reps: int, warmup: int) -> Timing:
    """Run ``fn`` ``warmup`` times (discarded), then ``reps`` times: median and 75th-25th percentile spread. ``fn``
    times its own region, calling :func:`pace` right before it."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        samples.append(fn())
    q25, q50, q75 = np.percentile(samples, [25, 50, 75])
    return Timing(float(q50), float(q75 - q25), reps)


def _host_cache_bytes() -> int:
    """The largest CPU cache this machine reports (sysfs), or 0 when it reports none."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


_buffers: dict[torch.device, torch.Tensor] = {}


def evict_caches(device: torch.device) -> None:
    """Write a buffer larger than ``device``'s cache (a CUDA device's L2; the host's last-level cache, bounded by
    ``HOST_EVICT_MIN`` / ``HOST_EVICT_MAX``), so that the next timed run starts cold, as it does in training."""
    buf = _buffers.get(device)
    if buf is None:
        if device.type == "cuda":
            nbytes = 2 * torch.cuda.get_device_properties(device).L2_cache_size
        else:
            nbytes = min(max(_host_cache_bytes(), HOST_EVICT_MIN), HOST_EVICT_MAX)
        buf = _buffers[device] = torch.empty(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    buf.fill_(1.0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_costs(layer: nn.Module, reps: int = 3) -> tuple[dict[str, int], dict[str, float]]:
    """For every optimizer in ``OPTIMIZERS``, on a copy of ``layer``'s parameters: the bytes of its state after a
    step, and the median seconds of a step with cold caches (the first, which creates the state, not counted)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    nbytes, seconds = {}, {}
    for name in OPTIMIZERS:
        if not params:
            nbytes[name], seconds[name] = 0, 0.0
            continue
        copies = [p.detach().clone().requires_grad_(True) for p in params]
        for c in copies:
            c.grad = torch.full_like(c, 1e-3)
        opt = build_optimizer(copies, name)
        opt.step()
        nbytes[name] = sum(t.numel() * t.element_size() for t in tensors(list(opt.state.values())))
        times = []
        for _ in range(reps):
            evict_caches(copies[0].device)
            pace()
            t0 = time.perf_counter()
            opt.step()
            if copies[0].is_cuda:
                torch.cuda.synchronize(copies[0].device)
            times.append(time.perf_counter() - t0)
        seconds[name] = float(np.median(times))
        del opt, copies
    return nbytes, seconds

"""Does a configuration fit in memory? The planner's memory model applied before anything starts.

The model needs per-layer bytes (parameters, optimizer state, what autograd saves, inputs and outputs) at the
schedule's unit size. They are measured on the meta device, which allocates nothing, so any micro-batch size can
be priced in well under a second without a profile::

    peaks = estimate_peaks(chain, schedule, stage_layers, unit=4, optimizer="adamw", recompute=False)
    check_fits(cfg, chain, schedule, stage_layers)   # ValueError naming --micro-batch-size when it cannot fit
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from chimera.microbatch import resized, tensors
from chimera.optim import build_optimizer
from chimera.plan.memory import GiB, WorkerMemory, parse_bytes, worker_memory
from chimera.profile import LayerCost, LayerProfile, Profile, Timing
from chimera.profile.layers import LayerRun
from chimera.schedule import Schedule

_ZERO = Timing(0.0, 0.0, 0)


def meta_profile(chain: Any, unit: int, optimizer: str) -> Profile:
    """A profile of ``chain`` with bytes only (every timing 0), measured on the meta device at ``unit`` samples
    (optimizer state: ``optimizer``'s only)."""
    inputs, labels = resized(chain.example, unit)
    bounds = chain.boundaries(unit)
    dev = torch.device("meta")
    layers = []
    x: Any = inputs
    for i in range(chain.num_layers):
        layer = chain.build_layers([i], 0, "meta")[0]
        last = i == chain.num_layers - 1
        run = LayerRun(layer, x, bounds[i] if i else None, nullcontext, dev, (chain.loss, labels) if last else None)
        out_bytes = 0 if last else sum(_nbytes(s.shape, s.dtype) for s in bounds[i + 1])
        in_bytes = sum(t.numel() * t.element_size() for t in tensors(x))
        cost = LayerCost(_ZERO, _ZERO, _ZERO, _ZERO, _ZERO, run.stash_bytes(), in_bytes, out_bytes)
        params = list(layer.parameters())
        tied = {}
        for (k, name_k), (j, name_j) in chain.tied_parameters():
            if i in (k, j):
                p = layer.get_parameter(name_k if i == k else name_j)
                tied[j if i == k else k] = p.numel() * p.element_size()
        opt_bytes = {optimizer: _optimizer_bytes(params, optimizer)}
        layers.append(LayerProfile(i, type(layer).__name__, sum(p.numel() for p in params),
                                   sum(p.numel() * p.element_size() for p in params), opt_bytes, {unit: cost}, tied))
        if not last:
            x = tuple(torch.empty(s.shape, dtype=s.dtype, device=dev) for s in bounds[i + 1])
    return Profile(chain.name, "meta", "meta", "float32", {}, 1, [unit], layers)


def estimate_peaks(chain: Any, schedule: Schedule, stage_layers: Sequence[Sequence[int]], unit: int, optimizer: str,
                   recompute: bool, exchange: bool = True) -> list[WorkerMemory]:
    """The memory model's peak per worker of one data-parallel group, from a meta-device profile."""
    return worker_memory(meta_profile(chain, unit, optimizer), schedule, stage_layers, unit, optimizer, recompute, exchange)


def available_per_worker(cfg: Any, world: int) -> tuple[int, str] | None:
    """(bytes, where from) one worker may use: ``--memory-per-worker``, else the free memory of the visible GPU
    (``--device cuda``) or this machine's available memory shared by ``world`` workers; None when unknown."""
    t = cfg.training
    if t.memory_per_worker:
        return parse_bytes(t.memory_per_worker), f"--memory-per-worker {t.memory_per_worker}"
    if t.device == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info()
        return free, "free memory of this machine's GPU"
    import psutil

    avail = psutil.virtual_memory().available
    return avail // max(1, world), f"{avail / GiB:.1f} GiB available on this machine / {world} workers"


def check_fits(cfg: Any, chain: Any, schedule: Schedule, stage_layers: Sequence[Sequence[int]]) -> WorkerMemory:
    """The largest worker's peak; ValueError with the estimate and what to change when it exceeds the memory a
    worker has (:func:`available_per_worker`)."""
    s, t = cfg.schedule, cfg.training
    unit = int(s.micro_batch_size * schedule.microbatch_scale)
    peaks = estimate_peaks(chain, schedule, stage_layers, unit, t.optimizer, t.recompute, t.device != "cuda")
    worst = max(range(len(peaks)), key=lambda w: peaks[w].total)
    peak = peaks[worst]
    limit = available_per_worker(cfg, schedule.workers * schedule.data_parallel)
    if limit is not None and peak.total > limit[0]:
        raise ValueError(
            f"--micro-batch-size {s.micro_batch_size} cannot fit: the memory model estimates {peak.total / GiB:.2f} "
            f"GiB at worker {worst}'s peak (parameters {peak.params / GiB:.2f}, optimizer {peak.optimizer / GiB:.2f}, "
            f"gradients {peak.grads / GiB:.2f}, activations {peak.activations / GiB:.2f}, messages "
            f"{peak.messages / GiB:.2f}, gradient sums {peak.sync / GiB:.2f} GiB) but a worker has "
            f"{limit[0] / GiB:.2f} GiB ({limit[1]}); lower --micro-batch-size, add --recompute or more --stages, "
            "or set --memory-per-worker")
    return peak


def _optimizer_bytes(params: list[torch.nn.Parameter], name: str) -> int:
    """Bytes of the state ``name`` keeps for ``params`` after one step (on the meta device: nothing computed)."""
    copies = [p.detach().clone().requires_grad_(True) for p in params if p.requires_grad]
    if not copies:
        return 0
    for c in copies:
        c.grad = torch.empty_like(c)
    opt = build_optimizer(copies, name)
    opt.step()
    return sum(t.numel() * t.element_size() for t in tensors(list(opt.state.values())))


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize

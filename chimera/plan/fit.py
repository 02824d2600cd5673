"""Does a configuration fit in memory? The planner's memory model applied before anything starts.

The model needs per-layer bytes (parameters, optimizer state, what autograd saves, inputs and outputs) at the
schedule's unit size. They come from the chain's shapes on the meta device, which allocates nothing, so any
micro-batch size can be priced in well under a second without a profile::

    peaks = estimate_peaks(chain, schedule, stage_layers, unit=4, optimizer="adamw", recompute=False)
    check_fits(cfg, chain, schedule, stage_layers)   # ConfigError naming --micro-batch-size when it cannot fit
    ranked = fit_choice(cfg, chain, ranked, split)     # --schedule auto: candidates over the memory marked
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from chimera.plan.memory import GiB, WorkerMemory, parse_bytes, worker_memory
from chimera.profile.shapes import shapes_profile
from chimera.schedule import Schedule


def estimate_peaks(chain: Any, schedule: Schedule, stage_layers: Sequence[Sequence[int]], unit: int, optimizer: str,
                   recompute: bool, exchange: bool = True) -> list[WorkerMemory]:
    """The memory model's peak per worker of one data-parallel group, from the chain's shapes
    (:func:`chimera.profile.shapes.shapes_profile`)."""
    return worker_memory(shapes_profile(chain, unit), schedule, stage_layers, unit, optimizer, recompute, exchange)


def available_per_worker(cfg: Any, world: int) -> tuple[int, str] | None:
    """(bytes, where from) one worker may use: ``--memory-per-worker``, else the free memory of the visible GPU
    (``--device cuda``) or this machine's available memory shared by ``world`` workers; None when unknown."""
    t = cfg.training
    if t.memory_per_worker and t.memory_per_worker != "device":
        return parse_bytes(t.memory_per_worker), f"--memory-per-worker {t.memory_per_worker}"
    if t.device == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info()
        return free, "free memory of this machine's GPU"
    import psutil

    avail = psutil.virtual_memory().available
    return avail // max(1, world), f"{avail / GiB:.1f} GiB available on this machine / {world} workers"


def device_budget(cfg: Any) -> Any:
    """``cfg`` with ``--memory-per-worker device`` replaced by the bytes a worker has (:func:`available_per_worker`:
    the visible GPU's free memory, or this machine's available memory shared by the job's workers)."""
    from chimera.validation import ConfigError

    if cfg.training.memory_per_worker != "device":
        return cfg
    s = cfg.schedule
    have = available_per_worker(cfg, s.stages * s.data_parallel)
    if have is None:
        raise ConfigError("--memory-per-worker device: no GPU is visible here to read its memory from; give the "
                          "budget in bytes (e.g. 70GiB)")
    return cfg.with_flags(memory_per_worker=str(have[0]))


def check_fits(cfg: Any, chain: Any, schedule: Schedule, stage_layers: Sequence[Sequence[int]]) -> WorkerMemory:
    """The largest worker's peak; :class:`~chimera.validation.ConfigError` with the estimate and what to change
    when it exceeds the memory a worker has (:func:`available_per_worker`)."""
    from chimera.validation import ConfigError

    s, t = cfg.schedule, cfg.training
    unit = int(s.micro_batch_size * schedule.microbatch_scale)
    peaks = estimate_peaks(chain, schedule, stage_layers, unit, t.optimizer, t.recompute, t.device != "cuda")
    worst = max(range(len(peaks)), key=lambda w: peaks[w].total)
    peak = peaks[worst]
    limit = available_per_worker(cfg, schedule.workers * schedule.data_parallel)
    if limit is not None and peak.total > limit[0]:
        raise ConfigError(
            f"--micro-batch-size {s.micro_batch_size} cannot fit: the memory model estimates {peak.total / GiB:.2f} "
            f"GiB at worker {worst}'s peak (parameters {peak.params / GiB:.2f}, optimizer {peak.optimizer / GiB:.2f}, "
            f"gradients {peak.grads / GiB:.2f}, activations {peak.activations / GiB:.2f}, messages "
            f"{peak.messages / GiB:.2f}, gradient sums {peak.sync / GiB:.2f} GiB) but a worker has "
            f"{limit[0] / GiB:.2f} GiB ({limit[1]}); lower --micro-batch-size, add --recompute or more --stages, "
            "or set --memory-per-worker")
    return peak


def fit_budget(cfg: Any, chain: Any, sched: Schedule, stage_layers: list[list[int]], unit: int) -> tuple[Any, Schedule]:
    """The config (its offload policy chosen, for ``--offload auto``) and its schedule lowered with that policy.
    With ``--memory-per-worker`` the memory model prices it on the chain's shapes and a configuration that cannot
    fit is refused (ConfigError naming the bytes needed per policy against the budget)."""
    from chimera.plan.search import fit_offload
    from chimera.schedule import OFFLOAD_POLICIES, Offload, lower
    from chimera.validation import ConfigError

    t = cfg.training
    if t.offload_pack and any(a.kind.spec.part_of is not None for row in sched.actions for a in row):
        raise ConfigError(f"--offload-pack {t.offload_pack} streams a stage's weights through one backward, but a split "
                          "backward (I, then W later) needs them twice: drop --offload-pack or --split-backward")
    if t.memory_per_worker is None:
        try:
            return cfg, lower(sched, Offload(t.offload, t.prefetch, t.offload_pack))
        except ValueError as e:
            raise ConfigError(f"--offload {t.offload}: {e}") from None
    try:
        Offload(t.offload if t.offload != "auto" else "none", t.prefetch).check(sched.stages)
    except ValueError as e:
        raise ConfigError(f"--offload {t.offload}: {e}") from None
    policies = OFFLOAD_POLICIES if t.offload == "auto" else (t.offload,)
    try:
        off, lowered, _ = fit_offload(shapes_profile(chain, unit), sched, stage_layers, unit, t.optimizer,
                                      t.recompute, parse_bytes(t.memory_per_worker), policies, t.prefetch,
                                      exchange=t.device == "cpu", per_stage=t.offload == "auto", pack=t.offload_pack)
    except ValueError as e:
        raise ConfigError(f"--memory-per-worker {t.memory_per_worker}: {e}") from None
    return cfg.with_flags(offload=off.text), lowered


def fit_choice(cfg: Any, chain: Any, ranked: Sequence[Any], split: Callable[[int], list[list[int]]]) -> list[Any]:
    """``--schedule auto``'s ranking (:func:`chimera.schedule.best.rank`) with the candidates that the memory model
    says cannot fit marked (:func:`chimera.schedule.best.exclude`), so that its first is the fastest that fits.

    The budget is ``--memory-per-worker``, else the memory a worker has (:func:`available_per_worker`); each
    candidate is priced on ``split(stages)`` (its stage -> layers map) at its unit size, weights included, so that
    a schedule holding more of the model (Chimera 2, four-pipe Chimera 4 shares) pays for it. With a budget the
    configured offload is priced; with ``--offload auto`` a schedule that fits without offload is preferred to a
    faster one that needs it, and so on up the policies. When nothing fits, the ranking is returned unmarked and
    the checks that follow refuse the fastest, naming what to change.
    """
    from chimera.schedule import OFFLOAD_POLICIES, Offload, lower
    from chimera.schedule.best import exclude

    s, t = cfg.schedule, cfg.training
    have = available_per_worker(cfg, s.stages * s.data_parallel)
    if have is None:
        return list(ranked)
    budget = have[0]
    budgeted = t.memory_per_worker is not None
    policies = (OFFLOAD_POLICIES if t.offload == "auto" else (t.offload,)) if budgeted else (None,)
    profiles: dict[int, Any] = {}
    for policy in policies:
        over: dict[str, str] = {}
        for c in (c for c in ranked if c.fits):
            if t.offload_pack and c.options.get("split_backward"):
                over[c.label] = "--offload-pack needs a whole backward"
                continue
            sched = c.schedule
            unit = int(s.micro_batch_size * sched.microbatch_scale)
            if unit not in profiles:
                profiles[unit] = shapes_profile(chain, unit)
            try:
                off = Offload(policy, t.prefetch, t.offload_pack) if policy else None
                mem = worker_memory(profiles[unit], lower(sched, off) if off else sched, split(sched.stages), unit,
                                    t.optimizer, t.recompute, t.device != "cuda", offload=off)
            except ValueError as e:
                over[c.label] = str(e)
                continue
            need = max(m.total for m in mem)
            if need <= budget:
                return exclude(ranked, over)
            over[c.label] = f"needs {need / GiB:.2f} of {budget / GiB:.2f} GiB" + (
                f" with --offload {policy}" if policy and policy != "none" else "")
    return list(ranked)


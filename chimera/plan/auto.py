"""Planning inside a run: the planned partition (``--partition planned``) and ``--plan PATH|auto``.

Both need a profile of the model as the workers will run it (device, threads per worker, micro-batch size). It
is taken briefly on the driver before any worker starts and kept in ``profiles/`` (reused while it matches the
model, device, library versions, threads and sizes)::

    layers, prediction = planned_partition(cfg, chain, schedule)
    cfg, plan = apply_plan(cfg, "auto")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chimera.plan.memory import parse_bytes
from chimera.plan.partition import layers_of, plan_partition
from chimera.plan.planfile import Plan
from chimera.plan.search import plan
from chimera.profile import CommProfile, Profile, ProfileError
from chimera.schedule import Offload, Schedule

PROFILE_DIR = Path("profiles")


def memory_limit(cfg: Any) -> int | None:
    """``--memory-per-worker`` in bytes (None: no limit)."""
    text = cfg.training.memory_per_worker
    return parse_bytes(text) if text else None


def sharing(world: int, device: str) -> int:
    """How many processes to profile at once: on CPU every worker (they share the machine's cores, also when
    they outnumber them, and each timing should carry its share), on GPUs 1 (one device each)."""
    return 1 if device == "cuda" else max(1, world)


def cached_profile(chain: Any, sizes: Sequence[int], device: str, threads: int, concurrent: int = 1,
                   comm: Callable[[], CommProfile] | None = None, reps: int = 3) -> Profile:
    """A profile of ``chain`` at ``sizes`` on ``device`` with ``threads`` threads per process and ``concurrent``
    processes at once: the one kept in ``profiles/`` when it still matches, else a new one (taken and kept)."""
    from chimera.profile.layers import profile_chain

    path = PROFILE_DIR / f"{chain.name}.{device}.t{threads}.x{concurrent}.profile.json"
    try:
        prof = Profile.load(path).check(chain, device=device)
        if set(sizes) <= set(prof.micro_batch_sizes) and prof.threads == threads and (comm is None or prof.comm):
            return prof
    except ProfileError:
        pass
    prof = profile_chain(chain, sorted(set(sizes)), device=device, reps=reps, warmup=1, threads=threads,
                         comm=comm() if comm else None, concurrent=concurrent)
    prof.save(path)
    return prof


def planned_partition(cfg: Any, chain: Any, schedule: Schedule) -> tuple[list[list[int]], dict[str, Any]]:
    """The layers of every stage that minimise the simulated step for this schedule, and the prediction."""
    world = schedule.workers * schedule.data_parallel
    unit = int(cfg.schedule.micro_batch_size * schedule.microbatch_scale)
    device = cfg.training.device
    prof = cached_profile(chain, [unit], device, cfg.worker_threads(world), sharing(world, device))
    t = cfg.training
    offload = Offload(t.offload, t.prefetch, t.offload_pack) if t.offload != "auto" else None  # auto: decided on this partition
    part = plan_partition(prof, schedule, unit, t.recompute, t.optimizer, memory_limit(cfg),
                          exchange=t.device != "cuda", offload=offload)
    prediction = {"step_s": part.step_s, "bubble": part.bubble, "peak_memory_bytes": part.peak_memory,
                  "partition": part.sizes, "profile": f"{prof.model} on {prof.device}, {prof.threads} thread(s)"}
    return layers_of(part.sizes), prediction


def apply_plan(cfg: Any, spec: str, chain: Any, comm: Callable[[], CommProfile] | None = None) -> tuple[Any, Plan]:
    """``cfg`` with the plan of ``spec``: a plan file, or ``auto`` (profile briefly, then plan for the workers and
    global batch that ``cfg`` asks for)."""
    if spec != "auto":
        chosen = Plan.load(spec)
        return chosen.apply(cfg), chosen
    s = cfg.schedule
    workers = s.stages * s.data_parallel
    global_batch = s.micro_batches * s.micro_batch_size * s.data_parallel
    sizes = sorted({b for b in (s.micro_batch_size // 2, s.micro_batch_size, 2 * s.micro_batch_size) if b >= 1})
    device = cfg.training.device
    prof = cached_profile(chain, sizes, device, cfg.worker_threads(workers), sharing(workers, device), comm)
    result = plan(prof, workers, global_batch, memory_limit(cfg), cfg.training.optimizer,
                  exchange=cfg.training.device != "cuda")
    chosen = Plan.from_result(result, chain.name, prof.fingerprint, prof.device)
    return chosen.apply(cfg), chosen

"""The planner: enumerate configurations, prune, partition, simulate, rank.

For K workers and a global batch G it considers every schedule the runtime runs (GPipe, 1F1B, interleaved
with two chunks per worker, Chimera in its three modes), every depth D dividing K (W = K / D), every profiled
micro-batch size B with N = G / (B W) micro-batches, and recomputation where memory asks for it. A candidate the
runtime cannot run, or whose best partition does not fit the memory limit, is kept with the reason. The others
are partitioned (``chimera.plan.partition``) and simulated with the profile's costs; a candidate whose lower
bound (its busiest worker's compute) cannot beat the current top list is not simulated::

    result = plan(profile, workers=8, global_batch=64, memory_limit=80 * GiB)
    result.ranked[0].candidate.flags()       # {"schedule": "chimera", "stages": 4, ...}
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from chimera.plan.partition import PartitionResult, plan_partition
from chimera.profile import Profile
from chimera.schedule import ScheduleConfigError, build_schedule

SCHEDULES = (("gpipe", "direct"), ("1f1b", "direct"), ("interleaved", "direct"), ("chimera", "direct"),
             ("chimera", "doubling"), ("chimera", "halving"))


@dataclass(frozen=True)
class Candidate:
    """One configuration: schedule (and Chimera mode), D, W, B, N, recomputation."""

    schedule: str
    mode: str
    stages: int
    data_parallel: int
    micro_batch_size: int
    micro_batches: int
    recompute: bool
    chunks: int = 2

    @property
    def unit(self) -> int:
        """Samples per schedule unit (halving trains on half micro-batches)."""
        return self.micro_batch_size // 2 if self.mode == "halving" else self.micro_batch_size

    def flags(self) -> dict[str, Any]:
        """The training flags of this candidate (``TrainConfig.with_flags``)."""
        return {"schedule": self.schedule, "mode": self.mode, "stages": self.stages,
                "data_parallel": self.data_parallel, "micro_batch_size": self.micro_batch_size,
                "micro_batches": self.micro_batches, "recompute": self.recompute, "chunks": self.chunks}

    @property
    def label(self) -> str:
        name = self.schedule if self.schedule != "chimera" else f"chimera-{self.mode}"
        return name + ("+recompute" if self.recompute else "")


@dataclass(frozen=True)
class Evaluated:
    """A candidate with its prediction, or the reason it cannot run."""

    candidate: Candidate
    step_s: float | None = None
    samples_per_s: float | None = None
    bubble: float | None = None
    peak_memory: int | None = None
    partition: list[int] | None = None
    reason: str | None = None


@dataclass
class PlanResult:
    """Ranked feasible candidates (best first), infeasible ones with reasons, and how many were pruned."""

    ranked: list[Evaluated]
    infeasible: list[Evaluated]
    pruned: int = 0
    inputs: dict[str, Any] = field(default_factory=dict)


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def candidates(num_layers: int, workers: int, global_batch: int, sizes: Sequence[int]
               ) -> Iterator[tuple[Candidate, str | None]]:
    """Every (candidate, reason it cannot run or None) without recomputation."""
    for d in _divisors(workers):
        w = workers // d
        for name, mode in SCHEDULES:
            if d == 1 and name != "1f1b":
                continue  # one stage: every schedule is the same
            for b in sizes:
                if global_batch % (b * w):
                    continue  # this B cannot make the global batch at this width
                c = Candidate(name, mode, d, w, b, global_batch // (b * w), False)
                yield c, _why_not(c, num_layers, sizes)


def _why_not(c: Candidate, num_layers: int, sizes: Sequence[int]) -> str | None:
    parts = c.stages * (c.chunks if c.schedule == "interleaved" else 1)
    if parts > num_layers:
        return f"{parts} stages > {num_layers} layers"
    try:
        build_schedule(c.schedule, c.stages, c.micro_batches, chunks=c.chunks, mode=c.mode)
    except ScheduleConfigError as e:
        return str(e)
    if c.mode == "halving" and c.micro_batch_size % 2:
        return f"halving splits micro-batches in two: B = {c.micro_batch_size} is odd"
    if c.mode == "halving" and c.unit not in sizes:
        return f"halving runs half micro-batches of {c.unit}, a size the profile lacks"
    return None


def plan(profile: Profile, workers: int, global_batch: int | None = None, memory_limit: int | None = None,
         optimizer: str = "adamw", top: int = 10, exchange: bool = True, refine: int = 3) -> PlanResult:
    """Rank the configurations of ``profile``'s model on ``workers`` workers (module docstring).

    Every candidate is first simulated with its load-balanced partition; the best ``refine`` x ``top`` then get
    their partition refined by simulation (``chimera.plan.partition``) and are ranked again."""
    sizes = sorted(profile.micro_batch_sizes)
    g = global_batch or max(sizes) * workers
    result = PlanResult([], [], inputs={"workers": workers, "global_batch": g, "memory_limit": memory_limit,
                                        "optimizer": optimizer})
    pending = []
    work: dict[tuple[int, bool], float] = {}
    for c, why in candidates(len(profile.layers), workers, g, sizes):
        if why:
            result.infeasible.append(Evaluated(c, reason=why))
        else:
            pending.append((_lower_bound(profile, c, work), c))
    pending.sort(key=lambda x: x[0])
    best: list[float] = []  # max-heap (negated) of the top step times so far
    for bound, c in pending:
        if len(best) >= top and bound >= -best[0]:
            result.pruned += 1
            continue
        ev = _evaluate(profile, c, memory_limit, optimizer, exchange, rounds=0)
        if ev.reason is not None and "memory" in ev.reason and not c.recompute:
            result.infeasible.append(ev)  # try the same configuration recomputing
            ev = _evaluate(profile, Candidate(**{**c.flags(), "recompute": True}), memory_limit, optimizer, exchange,
                           rounds=0)
        if ev.reason is not None:
            result.infeasible.append(ev)
            continue
        result.ranked.append(ev)
        heapq.heappush(best, -ev.step_s)  # type: ignore[operator]
        if len(best) > top:
            heapq.heappop(best)
    result.ranked.sort(key=lambda e: e.step_s)  # type: ignore[arg-type,return-value]
    head = [_evaluate(profile, e.candidate, memory_limit, optimizer, exchange) for e in result.ranked[:refine * top]]
    result.ranked[:len(head)] = [h if h.reason is None and h.step_s <= e.step_s else e  # type: ignore[operator]
                                 for h, e in zip(head, result.ranked)]
    result.ranked.sort(key=lambda e: e.step_s)  # type: ignore[arg-type,return-value]
    return result


def _lower_bound(profile: Profile, c: Candidate, cache: dict[tuple[int, bool], float]) -> float:
    """Seconds the busiest worker computes at best: the whole model's work spread evenly over its D workers."""
    key = (c.unit, c.recompute)
    if key not in cache:
        t = profile.stage_seconds(range(len(profile.layers)), c.unit)
        cache[key] = t["forward"] + t["backward"] + (t["recompute"] if c.recompute else 0.0)
    units = c.micro_batches * (2 if c.mode == "halving" else 1)
    return units * cache[key] / c.stages


def _evaluate(profile: Profile, c: Candidate, memory_limit: int | None, optimizer: str, exchange: bool,
              rounds: int = 8) -> Evaluated:
    sched = build_schedule(c.schedule, c.stages, c.micro_batches, chunks=c.chunks, mode=c.mode,
                           data_parallel=c.data_parallel)
    part: PartitionResult = plan_partition(profile, sched, c.unit, c.recompute, optimizer, memory_limit, exchange,
                                           rounds=rounds)
    peak = part.peak_memory
    if memory_limit is not None and peak > memory_limit:
        return Evaluated(c, peak_memory=peak, partition=part.sizes,
                         reason=f"needs {peak / 2**30:.2f} GiB on a worker, more than the {memory_limit / 2**30:.2f} "
                                "GiB memory limit")
    samples = c.micro_batch_size * c.micro_batches * c.data_parallel
    return Evaluated(c, part.step_s, samples / part.step_s if part.step_s else None, part.bubble, peak, part.sizes)

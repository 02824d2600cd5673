"""The one simulator: replay a schedule with per-action costs.

Usage::

    >>> from fractions import Fraction
    >>> from chimera.schedule import build_schedule, simulate, Costs
    >>> r = simulate(build_schedule("chimera", 4, 4), Costs(fwd=1, bwd=2))
    >>> r.makespan, r.peak_activations
    (16, [3, 4, 4, 3])

Costs are per micro-batch (scaled by the schedule's ``microbatch_scale`` and by an action's ``count``);
pass ints or :class:`fractions.Fraction` for exact results. Busy time counts F and B only, so
``bubble = 1 - sum(busy) / (workers * makespan)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from chimera.schedule.ir import Action, Schedule
from chimera.schedule.kinds import SPECS, Address, Res
from chimera.schedule.replay import replay
from chimera.schedule.validate import ScheduleError, format_grid

Num = Any  # int, float or Fraction


@dataclass(frozen=True)
class Costs:
    """Per-action costs: scalars, or one value per stage for ``fwd``, ``bwd`` and ``allreduce``.

    ``p2p_latency + p2p_bytes / p2p_bandwidth`` is the time of one message (0 bandwidth: no byte term);
    ``optimizer`` is the optimizer step.
    """

    fwd: Num | Sequence[Num] = 1
    bwd: Num | Sequence[Num] = 2
    p2p_latency: Num = 0
    p2p_bytes: Num | Sequence[Num] = 0
    p2p_bandwidth: Num = 0
    allreduce: Num | Sequence[Num] = 0
    optimizer: Num = 0

    def stage_value(self, value: Num | Sequence[Num], stage: int) -> Num:
        return value[stage] if isinstance(value, Sequence) else value

    def of(self, a: Action, scale: Num = 1) -> Num:
        """What ``a`` costs: the field its kind names in the kinds table; per micro-batch fields scale with the
        action's ``count`` and the schedule's ``microbatch_scale``."""
        spec = SPECS[a.kind]
        if spec.cost is None:
            return 0
        if spec.cost == "message":
            return self.message()
        value = self.stage_value(getattr(self, spec.cost), a.stage)
        if spec.address is not Address.MICROBATCH:
            return value
        v = value * a.count
        return v if scale == 1 else v * scale

    def message(self, key: Any = None) -> Num:
        """One message's time; per-stage ``p2p_bytes`` are the bytes the stage that made it sends."""
        if self.p2p_bandwidth:
            nbytes = self.p2p_bytes[key.stage] if isinstance(self.p2p_bytes, Sequence) else self.p2p_bytes
            return self.p2p_latency + nbytes / self.p2p_bandwidth
        return self.p2p_latency


@dataclass(frozen=True)
class SimResult:
    """What a simulated iteration looks like.

    ``starts[w][i]`` / ``ends[w][i]`` belong to ``schedule.actions[w][i]``.
    """

    schedule: Schedule
    makespan: Num
    busy: list[Num]
    bubble: Num
    peak_activations: list[Num]
    starts: list[list[Num]]
    ends: list[list[Num]]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary: makespan, bubble, busy and peak_activations (lists per worker)."""

        def num(x: Num) -> float | int:
            return int(x) if x == int(x) else float(x)

        return {
            "schedule": self.schedule.name,
            "stages": self.schedule.stages,
            "workers": self.schedule.workers,
            "microbatches": self.schedule.microbatches,
            "makespan": num(self.makespan),
            "bubble": float(self.bubble),
            "busy": [num(b) for b in self.busy],
            "peak_activations": [num(p) for p in self.peak_activations],
        }


def peak_activations(schedule: Schedule) -> list[Num]:
    """Per worker, the most micro-batches (times ``microbatch_scale``) stashed for a backward at once."""
    out = []
    for row in schedule.actions:
        live = peak = 0
        for a in row:
            spec = SPECS[a.kind]
            if Res.STASH in spec.produces:
                live += a.count
                peak = max(peak, live)
            elif Res.STASH in spec.releases:
                live -= a.count
        v = peak * schedule.microbatch_scale
        out.append(int(v) if v.denominator == 1 else v)
    return out


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Replay ``schedule`` (compute-only or lowered) with ``costs``; raise ScheduleError on deadlock."""
    c = costs or Costs()
    scale = schedule.microbatch_scale
    r = replay(schedule, cost=lambda a: c.of(a, scale), p2p=c.message, allreduce=lambda s: c.stage_value(c.allreduce, s))
    if r.stuck:
        marks = {w: i for w, (i, _) in r.stuck.items()}
        why = "; ".join(f"worker {w} at step {i}: {m}" for w, (i, m) in sorted(r.stuck.items()))
        raise ScheduleError(f"cannot simulate {schedule.name}: deadlock: {why}\n{format_grid(schedule, marks)}")
    zero = c.optimizer * 0
    busy = []
    for w, row in enumerate(schedule.actions):
        total = zero
        for i, a in enumerate(row):
            if a.kind.is_compute:
                total += r.ends[w][i] - r.starts[w][i]
        busy.append(total)
    ends = [e for row in r.ends for e in row]
    starts = [s for row in r.starts for s in row]
    makespan = (max(ends) - min(starts)) if ends else zero
    nw = schedule.workers
    total = sum(busy)
    if isinstance(total, int | Fraction) and isinstance(makespan, int | Fraction):
        total = Fraction(total)  # exact bubble for exact costs
    bubble = 1 - total / (nw * makespan) if makespan else zero
    return SimResult(schedule, makespan, busy, bubble, peak_activations(schedule), r.starts, r.ends)

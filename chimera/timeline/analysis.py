"""Measured figures from timeline events: per-step makespan, busy time and bubble fraction."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from chimera.timeline.events import Event, is_compute, is_swap


@dataclass(frozen=True)
class StepStats:
    """One iteration as measured: makespan (first start to last end, all workers) and busy time per worker."""

    iteration: int
    makespan: float
    busy: dict[int, float]

    @property
    def bubble(self) -> float:
        """``1 - sum(busy) / (workers * makespan)``, the same definition as the simulator's."""
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan) if self.makespan > 0 else 0.0


def step_stats(events: Iterable[Event], workers: Iterable[int] | None = None, compute_only: bool = False
               ) -> list[StepStats]:
    """Group events by iteration and compute :class:`StepStats` for each (workers default: those present).

    ``compute_only``: the makespan spans the compute actions only (first start to last end), the window the
    simulator predicts for a compute-only schedule; the default spans every event, gradient sums and the
    optimizer step included."""
    by_iter: dict[int, list[Event]] = {}
    for e in events:
        by_iter.setdefault(e.iteration, []).append(e)
    out = []
    for it in sorted(by_iter):
        evs = by_iter[it]
        ws = sorted(set(workers) if workers is not None else {e.worker for e in evs})
        busy = {w: 0.0 for w in ws}
        for e in evs:
            if is_compute(e.kind) and e.worker in busy:
                busy[e.worker] += e.duration
        span = [e for e in evs if is_compute(e.kind)] if compute_only else evs
        makespan = max(e.end for e in span) - min(e.start for e in span) if span else 0.0
        out.append(StepStats(it, makespan, busy))
    return out


def swap_time(events: Iterable[Event]) -> dict[str, float]:
    """Seconds of swaps per iteration (mean over iterations, summed over workers): ``hidden`` under a compute
    action of the same worker (a copy stream overlapping it), ``exposed`` the rest."""
    by: dict[tuple[int, int], tuple[list[Event], list[Event]]] = {}
    for e in events:
        swap = is_swap(e.kind)
        if swap or is_compute(e.kind):
            by.setdefault((e.iteration, e.worker), ([], []))[swap].append(e)
    hidden = exposed = 0.0
    for compute, swaps in by.values():
        for s in swaps:
            under = sum(max(0.0, min(s.end, c.end) - max(s.start, c.start)) for c in compute)
            hidden += min(under, s.duration)
            exposed += max(0.0, s.duration - under)
    iterations = max(1, len({it for it, _ in by}))
    return {"hidden": hidden / iterations, "exposed": exposed / iterations}

"""What a stalled run waits on: every worker's pending action on the validator's step x worker grid, and who
waits for whom.

The driver asks every worker where it is (:meth:`chimera.runtime.PipelineWorker.pending`) when one stalls and
prints::

    hang_report(job.schedule, {0: {"step": 3, "index": 5}, 1: {"step": 3, "index": None}})
"""

from __future__ import annotations

from typing import Any

from chimera.schedule import Action, Kind, Schedule
from chimera.schedule.kinds import message
from chimera.schedule.validate import format_grid


def _peers(schedule: Schedule, worker: int, a: Action) -> list[int]:
    """The workers (of the same data-parallel group) that ``a`` cannot complete without."""
    if a.kind.is_p2p:
        _, stage = message(a.kind, a.pipe, a.stage, a.microbatch)
        return [schedule.placement[(a.pipe, stage)]]
    if a.kind is Kind.ALLREDUCE_WAIT:
        return sorted({r % schedule.workers for r in schedule.stage_group(a.stage)} - {worker})
    # the global gradient norm is summed over every rank: the optimizer step waits for it, and a post-validated
    # stage update for the previous step's (VALIDATE only starts it)
    if a.kind in (Kind.OPTIMIZER_STEP, Kind.STAGE_UPDATE):
        return [w for w in range(schedule.workers) if w != worker]
    return []


def hang_report(schedule: Schedule, where: dict[int, dict[str, Any] | None], group: int = 0) -> str:
    """The grid of data-parallel ``group`` with every worker's pending action marked ``>..<``, then one line per
    worker: its step, the action it waits on and the workers it waits for (with where those are).

    ``where[w]``: ``{"step": s, "index": i}`` (``i`` None: between steps or not started), None: no answer."""
    rows = schedule.actions
    marks = {w: at["index"] for w, at in where.items() if at and at.get("index") is not None}
    lines = [format_grid(schedule, marks)]
    for w in range(schedule.workers):
        at = where.get(w)
        rank = group * schedule.workers + w
        if at is None:
            lines.append(f"worker {rank}: no answer (dead or busy outside the schedule)")
            continue
        if at.get("index") is None:
            lines.append(f"worker {rank}: step {at['step']}, not inside the action list (before its first action "
                         "or after its last)")
            continue
        a = rows[w][at["index"]]
        waits = []
        for p in _peers(schedule, w, a):
            there = where.get(p)
            pos = ("no answer" if there is None else "outside the action list" if there.get("index") is None
                   else f"at {there['index']}: {rows[p][there['index']].text(schedule.bidirectional)}, step "
                   f"{there['step']}")
            waits.append(f"worker {group * schedule.workers + p} ({pos})")
        lines.append(f"worker {rank}: step {at['step']}, action {at['index']} {a.text(schedule.bidirectional)} "
                     f"({a.kind.value}, micro-batch {a.microbatch})"
                     + (f" waits for {', '.join(waits)}" if waits else ""))
    return "\n".join(lines)

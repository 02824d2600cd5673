"""Timing a replayed schedule where workers share CPU cores (more workers than cores on a machine).

:meth:`Replay.times <chimera.schedule.replay.Replay.times>` gives every worker a core of its own. Here worker w's
CPU work runs on ``core[w]``, one action's at a time: each action's first ``cpu`` seconds of its duration hold its
worker's core (the runtime dispatching it, posting its messages, a CPU stage's compute); what is left (a sleep, a
device's compute) does not. An action takes its core when it is ready (its worker free, its inputs there) and the
core is free; actions take a core in the order they become ready (first come, first served, no preemption, ties by
flat index). That is an approximation: Linux may let a woken thread preempt the running one instead (holding the
core at the end of an action, after its sleep, predicted the benchmark's rows no better: ``bench/RESULTS.md``, issue
29's sixteenth round). The pass follows time: a heap of the actions whose worker and inputs are done, instead of
one sweep over the replay's order.

On the 2-core development machine with four workers pinned two to a core (``chimera.util.cores.core_sets``), this
is what a pipeline of short actions waits for: a receiver woken while the other worker on its core computes waits
for that action to end.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from chimera.schedule.replay import Replay

Num = Any  # int, float or Fraction


def times_on_cores(plan: Replay, duration: Sequence[Num], cpu: Sequence[Num], delay: Sequence[Num],
                   core: Sequence[int]) -> tuple[list[Num], list[Num]]:
    """Start and end of every action of ``plan`` (flat indices, as :meth:`Replay.times`) when the first
    ``cpu[slot]`` of each action's ``duration[slot]`` holds its worker's core ``core[w]`` (module docstring).
    With a core per worker the figures are :meth:`Replay.times`'s."""
    if plan.stuck:
        raise ValueError("a stuck plan has no times")
    n = plan.size
    prev, deps, slot = [n] * n, [()] * n, [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    need = [0] * n
    for i, p, ds, d in zip(plan.order, plan.prev, plan.deps, plan.slot):
        prev[i], deps[i], slot[i] = p, ds, d
        before = [q for q, _ in ds] + ([p] if p != n else [])
        need[i] = len(before)
        for q in before:
            succ[q].append(i)
    core_of = [core[w] for w in range(len(plan.bounds) - 1) for _ in range(plan.bounds[w], plan.bounds[w + 1])]
    end: list[Num] = [0] * (n + 1)  # end[n] stays 0: the "previous action" of each worker's first action
    start: list[Num] = [0] * n
    free: dict[int, Num] = {}

    def ready(i: int) -> Num:
        t = end[prev[i]]
        for q, s in deps[i]:
            if end[q] + delay[s] > t:
                t = end[q] + delay[s]
        return t

    heap = [(ready(i), i) for i in plan.order if not need[i]]
    heapq.heapify(heap)
    while heap:
        t, i = heapq.heappop(heap)
        hold = cpu[slot[i]]
        if hold:
            c = core_of[i]
            if c in free and free[c] > t:
                t = free[c]
            free[c] = t + hold
        start[i], end[i] = t, t + duration[slot[i]]
        for j in succ[i]:
            need[j] -= 1
            if not need[j]:
                heapq.heappush(heap, (ready(j), j))
    for i, p in plan.waits:
        start[i] = end[p]
    end.pop()
    return start, end

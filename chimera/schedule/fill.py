"""Zero-bubble schedules: split backward (I + W), ordered by a list scheduler that fills bubbles with W.

Every worker has a preferred order of its forwards and input-gradient backwards (its *main* actions). The
list scheduler runs the workers against each other in unit time (a forward costs ``fwd``, an I ``bwd``, a W
``wgrad`` per micro-batch, per stage where the :class:`~chimera.schedule.simulate.Costs` give them per stage;
messages are free) and, whenever a worker is free, starts

1. the first main action in its preferred order that can run (``in_order``: only the next one; else the next
   one of each stage's forwards and backwards); an input-gradient backward before a forward when both can run (it is on the
   critical path), and a forward only while the micro-batches it holds stay within its ``cap``;
2. else its oldest pending W (what fills the bubble);
3. else it waits for the next action anywhere to finish.

The resulting per-worker order is a compute-only :class:`~chimera.schedule.ir.Schedule`, valid by
construction (every list is what one deadlock-free run executed; forwards and backwards of one stage keep
micro-batch order, so channels match) and checked by the validator like any other.

The zero-bubble generators of :mod:`chimera.schedule.generators` (ZB-H1, ZB-H2) call :func:`zero_bubble` with
their memory limits; :func:`chimera_split` is Chimera's bidirectional order with split backward.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from chimera.schedule.ir import Action, Schedule, ScheduleConfigError, _replace
from chimera.schedule.kinds import PARTS, Kind
from chimera.schedule.simulate import Costs, peak_activations

_I, _W = PARTS[Kind.B]


EQUAL = Costs(fwd=1, bwd=1, wgrad=1)  # F = I = W: what orders are built with unless told
_SKIP_IDLE = True  # False: ask every free worker at every event (the reference the tests compare with)


class _Worker:
    def __init__(self, seq: Sequence[Action], cap: int | None, defer: int | None) -> None:
        # main actions left per kind, pipe and stage, in micro-batch order, with their place in the preferred order
        self.groups: dict[tuple[Kind, str, int], deque[tuple[int, Action]]] = {}
        for i, a in enumerate(seq):
            self.groups.setdefault((a.kind, a.pipe, a.stage), deque()).append((i, a))
        self.cap = cap
        self.defer = defer
        self.out: list[Action] = []
        self.pending_w: deque[Action] = deque()
        self.live = 0  # micro-batches forwarded, not yet through I
        self.held = 0  # micro-batches forwarded, not yet through W
        self.free_at = 0


class _Run:
    """What has run: the end time of every compute action, and per channel (sender, receiver, pipe) the messages
    in the order they were sent (a receiver must take them in that order, as the runtime's channels match
    messages in posting order)."""

    def __init__(self, stages: int, placement: Mapping[tuple[str, int], int]) -> None:
        self.stages = stages
        self.place = placement
        self.done: dict[tuple[Kind, str, int], dict[int, Any]] = {}  # (kind, pipe, stage) -> micro-batch -> end
        self.channels: dict[tuple[int, int, str], deque[tuple[Kind, str, int, int]]] = {}
        self._wiring: dict[tuple[Kind, str, int, int], _Wiring] = {}

    def _ends(self, kind: Kind, pipe: str, stage: int) -> dict[int, Any]:
        return self.done.setdefault((kind, pipe, stage), {})

    def wiring(self, a: Action, w: int) -> _Wiring:
        """What main actions of ``a``'s kind, pipe and stage on worker ``w`` wait for and send (fixed per group)."""
        key = (a.kind, a.pipe, a.stage, w)
        hit = self._wiring.get(key)
        if hit is None:
            s, f = a.stage, a.kind is Kind.F
            # what it consumes: the previous stage's forward, or its own and the next stage's I
            needs = [self._ends(Kind.F, a.pipe, s - 1)] if f and s > 0 else [] if f else [
                self._ends(Kind.F, a.pipe, s), *([self._ends(_I, a.pipe, s + 1)] if s < self.stages - 1 else [])]
            src, dst = (s - 1, s + 1) if f else (s + 1, s - 1)
            inbound = outbound = None
            if 0 <= src < self.stages and self.place[(a.pipe, src)] != w:  # its input comes from another worker
                inbound = ((self.place[(a.pipe, src)], w, a.pipe), Kind.F if f else _I, src)
            if 0 <= dst < self.stages and self.place[(a.pipe, dst)] != w:
                outbound = (w, self.place[(a.pipe, dst)], a.pipe)
            hit = self._wiring[key] = (needs, inbound, outbound, self._ends(a.kind, a.pipe, s))
        return hit

    def ready(self, a: Action, w: int, t: Any) -> bool:
        if a.kind is _W:
            return True
        needs, inbound, _, _ = self.wiring(a, w)
        for m in range(a.microbatch, a.microbatch + a.count):
            for ends in needs:
                end = ends.get(m)
                if end is None or end > t:
                    return False
        return inbound is None or self.channels[inbound[0]][0] == (inbound[1], a.pipe, inbound[2], a.microbatch)

    def start(self, a: Action, w: int, end: Any) -> None:
        if a.kind is _W:
            ends = self._ends(a.kind, a.pipe, a.stage)
            for m in range(a.microbatch, a.microbatch + a.count):
                ends[m] = end
            return
        _, inbound, outbound, ends = self.wiring(a, w)
        for m in range(a.microbatch, a.microbatch + a.count):
            ends[m] = end
        if inbound is not None:
            self.channels[inbound[0]].popleft()
        if outbound is not None:
            self.channels.setdefault(outbound, deque()).append((a.kind, a.pipe, a.stage, a.microbatch))


_Wiring = tuple[list[dict[int, Any]], tuple[tuple[int, int, str], Kind, int] | None, tuple[int, int, str] | None,
                dict[int, Any]]


def list_schedule(stages: int, placement: Mapping[tuple[str, int], int], seqs: Sequence[Sequence[Action]],
                  caps: Sequence[int | None] | None = None, defer: Sequence[int | None] | None = None,
                  in_order: bool = False, costs: Costs = EQUAL) -> list[list[Action]]:
    """Per worker, the order its main actions (F, I) and their W run in (module docstring)."""
    run = _Run(stages, placement)
    workers = [_Worker(seq, caps[w] if caps else None, defer[w] if defer else None) for w, seq in enumerate(seqs)]
    events: list[Any] = [0]
    t: Any = 0
    cost: dict[tuple[Kind, int, int], Any] = {}  # costs.of, per (kind, stage, count): asked once per action
    # A free worker that found nothing to start finds nothing again until an action it may wait for ends: its own,
    # or one at a neighbouring stage of a pipe (the only actions a main action waits for, and the only messages
    # that reach it). It is asked again only then (``dirty``); skipping it otherwise changes no choice.
    dirty = set(range(len(workers)))
    wake: dict[Any, set[int]] = {}  # end time -> workers an action ending then may let start something
    while events:
        t = heapq.heappop(events)
        while events and events[0] == t:
            heapq.heappop(events)
        dirty.update(wake.pop(t, ()))
        for i, w in enumerate(workers):
            if w.free_at > t or (_SKIP_IDLE and i not in dirty):
                continue
            a = _pick(w, i, t, run, in_order)
            if a is None:
                dirty.discard(i)
                continue
            key = (a.kind, a.stage, a.count)
            if key not in cost:
                cost[key] = costs.of(a)
            w.free_at = t + cost[key]
            run.start(a, i, w.free_at)
            w.out.append(a)
            heapq.heappush(events, w.free_at)
            woken = {i, *(placement[(a.pipe, s)] for s in (a.stage - 1, a.stage + 1) if 0 <= s < stages)}
            (dirty if w.free_at == t else wake.setdefault(w.free_at, set())).update(woken)
    stuck = [i for i, w in enumerate(workers) if w.groups or w.pending_w]
    if stuck:
        raise ScheduleConfigError(f"the zero-bubble list scheduler found no order for workers {stuck} within the "
                                  "memory limits")
    return [w.out for w in workers]


def _pick(w: _Worker, me: int, t: Any, run: _Run, in_order: bool) -> Action | None:
    """The action ``w`` starts at ``t`` (or None), removed from what it still has to run."""
    groups = w.groups
    if in_order:  # one stage's actions keep micro-batch order; the heads in the preferred order
        heads = [min(groups, key=lambda k: groups[k][0][0])] if groups else []
    else:
        heads = sorted(groups, key=lambda k: groups[k][0][0])
    best = None
    for key in heads:
        a = groups[key][0][1]
        if not run.ready(a, me, t):
            continue
        if a.kind is _I:
            best = key
            break
        if best is None and (w.cap is None or w.live + a.count <= w.cap) and (
                w.defer is None or w.held + a.count <= w.defer):
            best = key
    if best is not None:
        _, a = groups[best].popleft()
        if not groups[best]:
            del groups[best]
        if a.kind is Kind.F:
            w.live += a.count
            w.held += a.count
        else:
            w.live -= a.count
            w.pending_w.append(Action(_W, a.pipe, a.stage, a.microbatch, a.count))
        return a
    return _run_w(w) if w.pending_w else None  # its I has finished: the worker was busy with it until now


def _run_w(w: _Worker) -> Action:
    a = w.pending_w.popleft()
    w.held -= a.count
    return a


def _as_inputs(row: Sequence[Action]) -> list[Action]:
    """A compute-only row with every B as its I (the W follow from the scheduler)."""
    return [Action(_I, a.pipe, a.stage, a.microbatch, a.count) if a.kind is Kind.B else a for a in row]


def zero_bubble(base: Schedule, caps: Sequence[int | None] | None, defer: Sequence[int | None] | None,
                in_order: bool, name: str, costs: Costs = EQUAL) -> Schedule:
    """``base``'s order of forwards and backwards, backward split, W filling the bubbles (ordered with ``costs``)."""
    rows = list_schedule(base.stages, base.placement, [_as_inputs(r) for r in base.actions], caps, defer, in_order,
                         costs)
    return _replace(base, actions=rows, name=name)


def chimera_split(base: Schedule, costs: Costs = EQUAL) -> Schedule:
    """Chimera with split backward, from the Chimera schedule ``base`` (any mode).

    Every worker keeps Chimera's order of forwards and input-gradient backwards (so the two pipes keep meeting
    as in the basic unit) and fills every wait with its oldest pending W; a forward starts only while the
    micro-batches the worker holds (forwarded and not yet through W) stay within Chimera's own peak, so the split
    costs no activation memory. At F = B = W this is optimal for unit micro-batches: worker D/2 - 1 cannot start
    before D/2 - 1 forwards have reached it, and it has 3N units of work, so the makespan is at least
    D/2 - 1 + 3N (D = 8, N = 16: bubble 1 - 48/51 = 0.059, which this schedule reaches). Smaller units move
    that bound: under backward halving (``microbatch_scale`` 1/2) every action runs on half a micro-batch,
    forwards too, and the start-up wait halves (D = 8, N = 16: 0.030).
    """
    peak = int(max(peak_activations(base)) / base.microbatch_scale)  # in the schedule's units, as the caps count
    return zero_bubble(base, None, [peak] * base.workers, True, base.name, costs)


__all__ = ["EQUAL", "chimera_split", "list_schedule", "zero_bubble"]

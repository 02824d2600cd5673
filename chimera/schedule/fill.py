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

import bisect
import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from chimera.schedule.ir import Action, Schedule, ScheduleConfigError, _replace
from chimera.schedule.kinds import PARTS, Kind
from chimera.schedule.simulate import Costs, peak_activations

_I, _W = PARTS[Kind.B]


EQUAL = Costs(fwd=1, bwd=1, wgrad=1)  # F = I = W: what orders are built with unless told


class _Worker:
    def __init__(self, seq: Sequence[Action], cap: int | None, defer: int | None, in_order: bool) -> None:
        # main actions left per kind, pipe and stage, in micro-batch order, with their place in the preferred order
        self.groups: dict[tuple[Kind, str, int], deque[tuple[int, Action]]] = {}
        self.seq, self.pos = seq, 0  # in order: only the next of ``seq`` may start, so no groups are kept
        for i, a in enumerate(() if in_order else seq):
            self.groups.setdefault((a.kind, a.pipe, a.stage), deque()).append((i, a))
        # per group, [its key, its wiring once known]
        self.slots: dict[tuple[Kind, str, int], list[Any]] = {key: [key, None] for key in self.groups}
        self.wires: dict[tuple[Kind, str, int], _Wiring] = {}  # in order: per group, its wiring
        # each group's next action, in the preferred order (places are unique: the action and slot never compare),
        # those of input-gradient backwards apart: one that can start goes before any forward
        heads = sorted((q[0][0], q[0][1], self.slots[key]) for key, q in self.groups.items())
        self.inputs = [h for h in heads if h[1].kind is _I]
        self.others = [h for h in heads if h[1].kind is not _I]
        self.cap = cap
        self.defer = defer
        self.out: list[Action] = []
        self.pending_w: deque[tuple[Action, dict[int, Any]]] = deque()  # and where its end time goes
        self.live = 0  # micro-batches forwarded, not yet through I
        self.held = 0  # micro-batches forwarded, not yet through W
        self.free_at = 0

    def take(self, heads: list[tuple[int, Action, list[Any]]], at: int) -> None:
        """The next action of the group at ``heads[at]`` (``inputs`` or ``others``) removed; the group's next one
        takes its place."""
        _, _, slot = heads.pop(at)
        q = self.groups[slot[0]]
        q.popleft()
        if q:
            bisect.insort(heads, (*q[0], slot))
        else:
            del self.groups[slot[0]]


class _Run:
    """What has run: the end time of every compute action, and per channel (sender, receiver, pipe) the messages
    in the order they were sent (a receiver must take them in that order, as the runtime's channels match
    messages in posting order)."""

    def __init__(self, stages: int, placement: Mapping[tuple[str, int], int], fifo: bool = True,
                 step_size: Mapping[str, int] | None = None) -> None:
        self.stages = stages
        self.place = placement
        self.fifo = fifo
        # consecutive steps (list_schedule's step_size): per (stage, step) the micro-batch units of W due, and
        # [units of W started, the latest end among them]
        self.step = step_size
        self.due: dict[tuple[int, int], int] = {}
        self.made: dict[tuple[int, int], list[Any]] = {}
        self.done: dict[tuple[Kind, str, int], dict[int, Any]] = {}  # (kind, pipe, stage) -> micro-batch -> end
        self.channels: dict[tuple[int, int, str], deque[tuple[Kind, str, int, int]]] = {}
        self._wiring: dict[tuple[Kind, str, int, int], _Wiring] = {}

    def updated(self, stage: int, step: int, t: Any) -> bool:
        """Whether every replica of ``stage`` has made its weight gradients of ``step`` by ``t``."""
        made = self.made.get((stage, step))
        return made is not None and made[0] == self.due[(stage, step)] and made[1] <= t

    def _ends(self, kind: Kind, pipe: str, stage: int) -> dict[int, Any]:
        return self.done.setdefault((kind, pipe, stage), {})

    def wiring(self, a: Action, w: int) -> _Wiring:
        """What main actions of ``a``'s kind, pipe and stage on worker ``w`` wait for and send (fixed per group):
        the end times they wait for, the channel their input comes in on (and its message, less the micro-batch),
        the channel they send on, where their own end times go and (an I) where its W's go."""
        key = (a.kind, a.pipe, a.stage, w)
        hit = self._wiring.get(key)
        if hit is None:
            s, f = a.stage, a.kind is Kind.F
            # what it consumes: the previous stage's forward, or its own and the next stage's I
            needs = [self._ends(Kind.F, a.pipe, s - 1)] if f and s > 0 else [] if f else [
                self._ends(Kind.F, a.pipe, s), *([self._ends(_I, a.pipe, s + 1)] if s < self.stages - 1 else [])]
            src, dst = (s - 1, s + 1) if f else (s + 1, s - 1)
            inbound = outbound = expect = None
            if self.fifo and 0 <= src < self.stages and self.place[(a.pipe, src)] != w:  # input from another worker
                inbound = (self.place[(a.pipe, src)], w, a.pipe)
                expect = (Kind.F if f else _I, a.pipe, src)
            if self.fifo and 0 <= dst < self.stages and self.place[(a.pipe, dst)] != w:
                outbound = self.channels.setdefault((w, self.place[(a.pipe, dst)], a.pipe), deque())
            wends = self._ends(_W, a.pipe, s) if a.kind is _I else None
            hit = self._wiring[key] = (tuple(needs), inbound, outbound, self._ends(a.kind, a.pipe, s), expect, wends)
        return hit

    def start(self, a: Action, ends: dict[int, Any], wire: _Wiring | None, end: Any) -> None:
        """``a`` starts and ends at ``end`` (its group's end times ``ends``; a main action's wiring ``wire``)."""
        if wire is not None:
            inbound, outbound = wire[1], wire[2]
            if inbound is not None:
                self.channels[inbound].popleft()
            if outbound is not None:
                outbound.append((a.kind, a.pipe, a.stage, a.microbatch))
        elif self.step is not None:  # a W: the stage's update of its step waits for it
            made = self.made.setdefault((a.stage, a.microbatch // self.step[a.pipe]), [0, end])
            made[0] += a.count
            made[1] = max(made[1], end)
        if a.count == 1:
            ends[a.microbatch] = end
            return
        for m in range(a.microbatch, a.microbatch + a.count):
            ends[m] = end


_Wiring = tuple[tuple[dict[int, Any], ...], tuple[int, int, str] | None, deque[tuple[Kind, str, int, int]] | None,
                dict[int, Any], tuple[Kind, str, int] | None, dict[int, Any] | None]


def list_schedule(stages: int, placement: Mapping[tuple[str, int], int], seqs: Sequence[Sequence[Action]],
                  caps: Sequence[int | None] | None = None, defer: Sequence[int | None] | None = None,
                  in_order: bool = False, costs: Costs = EQUAL, fifo: bool = True,
                  step_size: Mapping[str, int] | None = None) -> list[list[Action]]:
    """Per worker, the order its main actions (F, I) and their W run in (module docstring).

    ``fifo``: a worker takes each channel's messages in the order they were sent. Without it, a main action waits
    only for what it consumes; the lowering (:func:`chimera.schedule.lowering.in_channel_order`) then posts the
    receives so that each channel's messages are still taken in order, which never adds a wait.

    ``step_size``: ``seqs`` hold consecutive training steps, step j of a pipe being its micro-batches
    ``j * step_size[pipe]`` on (:func:`chimera.schedule.steps.deferred`). A stage's main actions of step j wait
    for every W of the stage in step j-1 on all its replicas (the overlapped step boundary: the stage is updated
    between), nothing else; so a worker may run a step's forwards of one stage before the previous step's W of
    another (W deferred across the boundary). Pending W are taken oldest first, as within a step.
    """
    run = _Run(stages, placement, fifo, step_size)
    if step_size is not None:
        for seq in seqs:
            for a in seq:
                if a.kind is _I:
                    key = (a.stage, a.microbatch // step_size[a.pipe])
                    run.due[key] = run.due.get(key, 0) + a.count
    workers = [_Worker(seq, caps[w] if caps else None, defer[w] if defer else None, in_order)
               for w, seq in enumerate(seqs)]
    events: list[Any] = [0]
    t: Any = 0
    cost: dict[tuple[Kind, int, int], Any] = {}  # costs.of, per (kind, stage, count): asked once per action
    while events:
        t = heapq.heappop(events)
        while events and events[0] == t:
            heapq.heappop(events)
        for i, w in enumerate(workers):
            if w.free_at > t:
                continue
            picked = _pick(w, i, t, run, in_order)
            if picked is None:
                continue
            a, ends, wire = picked
            key = (a.kind, a.stage, a.count)
            if key not in cost:
                cost[key] = costs.of(a)
            w.free_at = t + cost[key]
            run.start(a, ends, wire, w.free_at)
            w.out.append(a)
            heapq.heappush(events, w.free_at)
    stuck = [i for i, w in enumerate(workers) if w.groups or (in_order and w.pos < len(w.seq)) or w.pending_w]
    if stuck:
        raise ScheduleConfigError(f"the zero-bubble list scheduler found no order for workers {stuck} within the "
                                  "memory limits")
    return [w.out for w in workers]


def _pick(w: _Worker, me: int, t: Any, run: _Run, in_order: bool
          ) -> tuple[Action, dict[int, Any], _Wiring | None] | None:
    """The action ``w`` starts at ``t`` (or None), removed from what it still has to run, with where its end time
    goes and (a main action) its wiring: the first in the preferred order that can start of its groups' next
    input-gradient backwards, else of its next forwards (only while its micro-batches stay within its limits),
    else its oldest pending W. ``in_order``: only the preferred order's next main action may start."""
    if in_order:
        return _pick_next(w, me, t, run)
    cap, defer, channels = w.cap, w.defer, run.channels
    for heads in (w.inputs, w.others):
        for at in range(len(heads)):
            _, a, slot = heads[at]
            if a.kind is not _I and ((cap is not None and w.live + a.count > cap) or (
                    defer is not None and w.held + a.count > defer)):
                continue
            wire = slot[1]
            if wire is None:
                wire = slot[1] = run.wiring(a, me)
            if not _ready(a, wire, channels, t, run):
                continue
            w.take(heads, at)
            return _started(w, a, wire)
    return _run_w(w) if w.pending_w else None  # its I has finished: the worker was busy with it until now


def _pick_next(w: _Worker, me: int, t: Any, run: _Run) -> tuple[Action, dict[int, Any], _Wiring | None] | None:
    """:func:`_pick` in order: the preferred order's next main action if it can start, else the oldest pending W."""
    if w.pos < len(w.seq):
        a = w.seq[w.pos]
        if a.kind is _I or ((w.cap is None or w.live + a.count <= w.cap)
                            and (w.defer is None or w.held + a.count <= w.defer)):
            key = (a.kind, a.pipe, a.stage)
            wire = w.wires.get(key)
            if wire is None:
                wire = w.wires[key] = run.wiring(a, me)
            if _ready(a, wire, run.channels, t, run):
                w.pos += 1
                return _started(w, a, wire)
    return _run_w(w) if w.pending_w else None


def _started(w: _Worker, a: Action, wire: _Wiring) -> tuple[Action, dict[int, Any], _Wiring]:
    """Main action ``a`` taken by ``w``: its micro-batches counted, an I's W pending."""
    if a.kind is Kind.F:
        w.live += a.count
        w.held += a.count
    else:
        w.live -= a.count
        w.pending_w.append((Action(_W, a.pipe, a.stage, a.microbatch, a.count), wire[5]))
    return a, wire[3], wire


def _ready(a: Action, wire: _Wiring, channels: dict[tuple[int, int, str], deque[Any]], t: Any, run: _Run) -> bool:
    """Whether main action ``a`` (of the group wired so) can start at ``t``: what it consumes was made by then,
    its input is the next message of its channel, and (consecutive steps) its stage was updated after the
    previous step."""
    needs, inbound, _, _, expect, _ = wire
    first = a.microbatch
    if run.step is not None:
        j = first // run.step[a.pipe]
        if j and not run.updated(a.stage, j - 1, t):
            return False
    if a.count == 1:
        for ends in needs:
            end = ends.get(first)
            if end is None or end > t:
                return False
    elif not _made(needs, first, a.count, t):
        return False
    return inbound is None or channels[inbound][0] == (*expect, first)


def _made(needs: tuple[dict[int, Any], ...], first: int, count: int, t: Any) -> bool:
    """Whether every end time in ``needs`` of micro-batches ``first`` .. ``first + count - 1`` is known and by ``t``."""
    for ends in needs:
        for m in range(first, first + count):
            end = ends.get(m)
            if end is None or end > t:
                return False
    return True


def _run_w(w: _Worker) -> tuple[Action, dict[int, Any], None]:
    a, ends = w.pending_w.popleft()
    w.held -= a.count
    return a, ends, None


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

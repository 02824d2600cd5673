"""The one simulator: replay a schedule with per-action costs.

Usage::

    >>> from fractions import Fraction
    >>> from chimera.schedule import build_schedule, simulate, Costs
    >>> r = simulate(build_schedule("chimera", 4, 4), Costs(fwd=1, bwd=2))
    >>> r.makespan, r.peak_activations
    (16, [3, 4, 4, 3])

Costs are per micro-batch (scaled by the schedule's ``microbatch_scale`` and by an action's ``count``);
pass ints or :class:`fractions.Fraction` for exact results. Busy time counts compute actions only, so
``bubble = 1 - sum(busy) / (workers * makespan)``.

A schedule is prepared once (:class:`Simulator`; :func:`simulate` keeps the preparation of each
``Schedule`` object while it lives), then every run only times the prepared order with the costs. Exact
costs run in plain integers over their common denominator; floats stay floats.
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import cached_property
from math import lcm
from operator import sub
from typing import Any

from chimera.schedule.cores import times_on_cores
from chimera.schedule.ir import Action, Schedule
from chimera.schedule.kinds import ACTIVATION_MEMORY, SPECS, Address, Kind, Msg, Res, Role
from chimera.schedule.kinds import message as message_of
from chimera.schedule.replay import Replay
from chimera.schedule.validate import ScheduleError, format_grid

Num = Any  # int, float or Fraction


@dataclass(frozen=True)
class Costs:
    """Per-action costs: scalars, or one value per stage for ``fwd``, ``bwd``, ``wgrad``, ``allreduce`` and
    ``p2p_bytes``.

    ``bwd`` is the input-gradient part of a backward (what an ``I`` action costs), ``wgrad`` its weight-gradient
    part (a ``W`` action); a full backward ``B`` costs ``bwd + wgrad``. With the default ``wgrad = 0``, ``bwd``
    is the whole backward.

    ``p2p_latency + p2p_bytes / p2p_bandwidth`` is the time of one message (0 bandwidth: no byte term); per
    stage, ``p2p_bytes[s]`` is the size of stage s's output activation: an activation message made by stage s
    has that size, the gradient made by stage s (with respect to its input) that of stage s-1's output.
    ``optimizer`` is the optimizer step; ``swap_in`` / ``swap_out`` (per stage) a stage replica's weights
    host -> device and gradients device -> host (offload). ``copy_overlap``: swap-ins run beside compute (a GPU
    copy stream) instead of occupying the worker (CPU).

    Worker time of communication (the kinds table's ``busy`` column): ``p2p_busy`` per send and per receive
    (posting it and completing it; a message leaves when its send's busy time ends, a receive is busy after its
    message arrived), ``sync_start`` / ``sync_wait`` per stage for a gradient sum's start (packing the
    gradients) and wait (unpacking the sum). All default to 0: communication that only delays.

    ``extra``: the costs of kinds registered beyond the built-in ones (``chimera.schedule.kinds.register_kind``),
    ``(name, value)`` pairs under the names their rows give (a value per stage, or one for all).

    ``fixed``: the runtime's own time per action of a kind, whatever it computes or carries, as ``(kind value,
    seconds)`` pairs (``("F", 2e-4)``: dispatching a forward, running the stage's Python, stashing): charged once
    per action (not per micro-batch of a doubled one) on top of its cost; measured by
    :func:`chimera.calibrate.measure_action_costs`.

    ``cores``: where workers share CPU cores, the core each worker runs on (one entry per worker; empty: a core
    each). Then an action holds its worker's core for its worker time, except that a compute action or an
    optimizer step holds it only for its ``fixed`` time unless ``cpu_compute`` (their work runs on the CPU, not on
    a device, in a sleep, or in what a step pays beyond its actions); see :mod:`chimera.schedule.cores`.
    """

    fwd: Num | Sequence[Num] = 1
    bwd: Num | Sequence[Num] = 2
    wgrad: Num | Sequence[Num] = 0
    p2p_latency: Num = 0
    p2p_bytes: Num | Sequence[Num] = 0
    p2p_bandwidth: Num = 0
    allreduce: Num | Sequence[Num] = 0
    optimizer: Num = 0
    swap_in: Num | Sequence[Num] = 0
    swap_out: Num | Sequence[Num] = 0
    copy_overlap: bool = False
    p2p_busy: Num = 0
    sync_start: Num | Sequence[Num] = 0
    sync_wait: Num | Sequence[Num] = 0
    extra: tuple[tuple[str, Any], ...] = ()
    fixed: tuple[tuple[str, Num], ...] = ()
    cores: tuple[int, ...] = ()
    cpu_compute: bool = True

    def field_value(self, name: str) -> Num | Sequence[Num]:
        """The cost field ``name``: one of the fields above, else an ``extra`` one (0 where none is given)."""
        if name in _FIELDS:
            return getattr(self, name)
        return next((v for k, v in self.extra if k == name), 0)

    def stage_value(self, value: Num | Sequence[Num], stage: int) -> Num:
        return value[stage] if isinstance(value, Sequence) else value

    def of(self, a: Action, scale: Num = 1) -> Num:
        """What ``a`` costs: the field its kind names in the kinds table; per micro-batch fields scale with the
        action's ``count`` and the schedule's ``microbatch_scale``."""
        spec = SPECS[a.kind]
        if spec.cost is None:
            return 0
        if spec.cost == "message":
            return self.message(message_of(a.kind, a.pipe, a.stage, a.microbatch)[0])
        fields = (spec.cost,) if isinstance(spec.cost, str) else spec.cost
        value = sum(self.stage_value(self.field_value(f), a.stage) for f in fields)
        if spec.address is not Address.MICROBATCH:
            return value
        v = value * a.count
        return v if scale == 1 else v * scale

    def worker_time(self, a: Action, scale: Num = 1) -> Num:
        """How long ``a`` occupies its worker: a communication kind its ``busy`` field (its delay is what
        :meth:`of` charges), any other kind :meth:`of`; either plus the kind's ``fixed`` time."""
        busy = SPECS[a.kind].busy
        t = self.stage_value(self.field_value(busy), a.stage) if busy is not None else self.of(a, scale)
        if self.fixed:
            t = t + dict(self.fixed).get(a.kind.value, 0)
        return t

    def core_time(self, a: Action, scale: Num = 1) -> Num:
        """How long ``a`` holds its worker's core where workers share cores (``cores``): its :meth:`worker_time`,
        or for a compute action or an optimizer step whose work is not on the CPU (``cpu_compute`` False) its
        ``fixed`` time alone."""
        if self.cpu_compute or SPECS[a.kind].role not in (Role.COMPUTE, Role.UPDATE):
            return self.worker_time(a, scale)
        return dict(self.fixed).get(a.kind.value, 0)

    def first_stage_whole_backward(self, stages: int) -> Costs:
        """These costs as the runtime splits a backward over ``stages`` stages: the first stage's inputs are data,
        which need no gradient, so its input-gradient part (I) computes nothing and its weight-gradient part (W)
        is its whole backward; every other stage keeps its own split. A full backward (B) costs the same."""
        bwd = [self.stage_value(self.bwd, s) for s in range(stages)]
        wgrad = [self.stage_value(self.wgrad, s) for s in range(stages)]
        wgrad[0] += bwd[0]
        bwd[0] = bwd[0] * 0
        return replace(self, bwd=bwd, wgrad=wgrad)

    def message(self, key: Msg | None = None) -> Num:
        """The time of message ``key`` (per-stage ``p2p_bytes`` need the key: its stage made it)."""
        if not self.p2p_bandwidth:
            return self.p2p_latency
        size = self.p2p_bytes
        if isinstance(size, Sequence):
            if key is None:
                raise ValueError("per-stage p2p_bytes: the message's key names the stage whose bytes it costs")
            size = size[key.stage if key.res is not Res.GRAD else key.stage - 1]
        return self.p2p_latency + size / self.p2p_bandwidth


_FIELDS = {f.name for f in dataclasses.fields(Costs)} - {"extra", "copy_overlap", "fixed", "cores", "cpu_compute"}


@dataclass(frozen=True)
class SimResult:
    """What a simulated iteration looks like.

    ``starts[w][i]`` / ``ends[w][i]`` belong to ``schedule.actions[w][i]`` (built on first access).
    """

    schedule: Schedule
    makespan: Num
    busy: list[Num]
    bubble: Num
    peak_activations: list[Num]
    _starts: list[Num] = field(repr=False, compare=False)  # flat, in units of 1/_unit
    _ends: list[Num] = field(repr=False, compare=False)
    _unit: int = field(default=1, repr=False, compare=False)

    @cached_property
    def starts(self) -> list[list[Num]]:
        """Start time of every action, per worker."""
        return self._rows(self._starts)

    @cached_property
    def ends(self) -> list[list[Num]]:
        """End time of every action, per worker."""
        return self._rows(self._ends)

    def _rows(self, flat: list[Num]) -> list[list[Num]]:
        if self._unit != 1:
            u = self._unit
            flat = [Fraction(t, u) for t in flat]
        rows, at = [], 0
        for row in self.schedule.actions:
            rows.append(flat[at:at + len(row)])
            at += len(row)
        return rows

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
    """Per worker, the most micro-batches (times ``microbatch_scale``) whose activations are held at once: stashed
    for a backward, or kept by an input-gradient backward for its weight-gradient part."""
    sign = {k: sum(r in ACTIVATION_MEMORY for r in s.produces) - sum(r in ACTIVATION_MEMORY for r in s.releases)
            for k, s in SPECS.items()}
    out = []
    for row in schedule.actions:
        live = peak = 0
        for a in row:
            d = sign[a.kind]
            if d:
                live += d * a.count
                if live > peak:
                    peak = live
        v = peak * schedule.microbatch_scale
        out.append(int(v) if v.denominator == 1 else v)
    return out


_PREPARED: dict[int, tuple[Replay, list[Num]]] = {}  # id(schedule) -> its plan and peaks, dropped with the schedule


def _prepare(schedule: Schedule) -> tuple[Replay, list[Num]]:
    # Keyed by id, not stored on the instance: a Schedule travels pickled (chimera.job.Job) and must stay small.
    # The finalizer drops the entry before the id can be reused.
    key = id(schedule)
    hit = _PREPARED.get(key)
    if hit is None:
        hit = _PREPARED[key] = (_replay(schedule), peak_activations(schedule))
        weakref.finalize(schedule, _PREPARED.pop, key, None)
    return hit


def _replay(schedule: Schedule, after: Mapping[int, Sequence[int]] | None = None) -> Replay:
    """``schedule`` replayed (with the ordering edges ``after``); ScheduleError with the grid if it deadlocks."""
    plan = Replay(schedule, after)
    if plan.stuck:
        marks = {w: i for w, (i, _) in plan.stuck.items()}
        why = "; ".join(f"worker {w} at step {i}: {m}" for w, (i, m) in sorted(plan.stuck.items()))
        raise ScheduleError(f"cannot simulate {schedule.name}: deadlock: {why}\n{format_grid(schedule, marks)}")
    return plan


def _common_denominator(values: Sequence[Num]) -> int | None:
    """The least common denominator of ``values`` when all are exact (ints, Fractions), else None."""
    unit = 1
    for v in values:
        if not isinstance(v, numbers.Rational):
            return None
        unit = lcm(unit, int(v.denominator))
    return unit


class Simulator:
    """``schedule`` prepared once (replayed without times); :meth:`run` times it with any :class:`Costs`.

    Raises :class:`ScheduleError` with the step x worker grid if the schedule deadlocks. ``after``: ordering edges
    beyond the kinds table (:class:`~chimera.schedule.replay.Replay`), for consecutive training steps
    (:mod:`chimera.schedule.steps`); such a preparation is not kept.
    """

    def __init__(self, schedule: Schedule, after: Mapping[int, Sequence[int]] | None = None) -> None:
        self.schedule = schedule
        if after:
            self._plan, self._peaks = _replay(schedule, after), peak_activations(schedule)
        else:
            self._plan, self._peaks = _prepare(schedule)

    def run(self, costs: Costs | None = None) -> SimResult:
        """Simulate one iteration with ``costs`` (default :class:`Costs`)."""
        c = costs or Costs()
        p = self._plan
        scale = self.schedule.microbatch_scale
        beside = c.copy_overlap  # a prefetch's cost moves from the worker to the wait of the compute after it
        duration = [0, *(0 if beside and SPECS[a.kind].role is Role.PREFETCH else c.worker_time(a, scale)
                         for a in p.durations)]
        if c.cores and len(c.cores) != self.schedule.workers:
            raise ValueError(f"Costs.cores names a core for each of {len(c.cores)} workers; {self.schedule.name} "
                             f"has {self.schedule.workers}: give one per worker, or none (a core each)")
        allreduce = [0] * p.stages
        for s in p.synced:
            allreduce[s] = c.stage_value(c.allreduce, s)
        fetch = [c.stage_value(c.swap_in, s) if beside else 0 for s in range(p.stages)]
        delay = [0, *allreduce, *fetch, *(c.message(k) for k in p.messages)]
        cpu = [0, *(min(c.core_time(a, scale), d) for a, d in zip(p.durations, duration[1:]))] if c.cores else []
        unit = _common_denominator(duration + delay + cpu)
        if unit is not None:  # exact: integers in units of 1/unit
            duration = [int(v.numerator) * (unit // int(v.denominator)) for v in duration]
            delay = [int(v.numerator) * (unit // int(v.denominator)) for v in delay]
            cpu = [int(v.numerator) * (unit // int(v.denominator)) for v in cpu]
        elif all(isinstance(v, numbers.Real) for v in duration + delay + cpu):
            duration, delay, cpu = [float(v) for v in duration], [float(v) for v in delay], [float(v) for v in cpu]
        if c.cores:
            starts, ends = times_on_cores(p, duration, cpu, delay, c.cores)
        else:
            starts, ends = p.times(duration, delay)
        return self._result(starts, ends, unit)

    def _result(self, starts: list[Num], ends: list[Num], unit: int | None) -> SimResult:
        p = self._plan
        # each worker's compute time, summed in its order (map: the same terms as a list of them, no list)
        busy = [sum(map(sub, map(ends.__getitem__, ids), map(starts.__getitem__, ids))) for ids in p.compute]
        makespan = max(ends) - min(starts) if ends else 0
        total, nw = sum(busy), len(busy)
        if not makespan:
            bubble = makespan
        elif unit is not None:
            bubble = 1 - Fraction(total, nw * makespan)
        else:
            bubble = 1 - total / (nw * makespan)
        if unit is not None and unit != 1:
            makespan, busy = Fraction(makespan, unit), [Fraction(b, unit) for b in busy]
        return SimResult(self.schedule, makespan, busy, bubble, list(self._peaks), starts, ends, unit or 1)


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Replay ``schedule`` (compute-only or lowered) with ``costs``; raise ScheduleError on deadlock.

    The first call on a ``Schedule`` object prepares it; later calls on the same object only time it.
    """
    return Simulator(schedule).run(costs)


def worker_bounds(schedule: Schedule, costs: Costs, whole_backward: bool) -> list[tuple[Num, Num]]:
    """Per worker, (reach, drain): times no simulation with ``costs`` of a schedule with ``schedule``'s placement,
    units and scale can beat, whatever its order (its actions are not read: a frame will do,
    :func:`chimera.schedule.registry.frame_schedule`), compute-only or lowered::

        makespan >= reach + drain  (for every worker)

    ``reach``: the earliest the worker's last compute action can end. Its first action waits for a first input
    to cross the stages before it in the pipe (one forward of one unit each, and the message wherever the next stage
    is on another worker; the least over the stages it holds), then it computes all of its units (each stage it
    holds forward and backward for every unit of its pipe); sends, receives, gradient sums and swaps only add.
    ``drain`` (``whole_backward``; else 0, as a weight-gradient part can end a worker's list): its last compute
    action is the backward of a unit, which the backwards of the same unit at every earlier stage of that pipe
    follow, on other workers (one on this worker would come later); the least such chain over the stages it holds.
    """
    scale = schedule.microbatch_scale
    chains: dict[tuple[Kind, str], list[Num]] = {}

    def chain(kind: Kind, pipe: str, stage: int) -> Num:
        if (kind, pipe) not in chains:
            chains[(kind, pipe)] = _chain(costs, schedule, pipe, kind, scale)
        return chains[(kind, pipe)][stage]

    out = []
    for w in range(schedule.workers):
        held = schedule.stages_of(w)
        busy = sum(schedule.pipe_microbatches(p) * (costs.of(Action(Kind.F, p, s, 0), scale)
                                                    + costs.of(Action(Kind.B, p, s, 0), scale)) for p, s in held)
        start = min(chain(Kind.F, p, s) for p, s in held)
        drain = min(chain(Kind.B, p, s) for p, s in held) if whole_backward else 0
        out.append((start + busy, drain))
    return out


def _chain(costs: Costs, schedule: Schedule, pipe: str, kind: Kind, scale: Num) -> list[Num]:
    """Per stage s of ``pipe``: one unit's ``kind`` (F or B) through stages 0 .. s-1, with the messages (the
    activation stage j makes, the gradient stage j+1 makes) between stages on different workers."""
    place = schedule.placement
    res, by = (Res.ACT, 0) if kind is Kind.F else (Res.GRAD, 1)
    total: Num = 0
    out = [total]
    for j in range(schedule.stages - 1):
        total += costs.of(Action(kind, pipe, j, 0), scale)
        if place[(pipe, j)] != place[(pipe, j + 1)]:
            total += costs.message(Msg(res, pipe, j + by, 0))
        out.append(total)
    return out

"""Consecutive training steps: a schedule's lists run ``k`` times over, and the steady-state period.

Usage::

    >>> from chimera.schedule import Costs, build_schedule
    >>> from chimera.schedule.steps import period
    >>> s = build_schedule("zb-h2", 4, 8, order_costs=Costs(fwd=1, bwd=1, wgrad=1))
    >>> p = period(s, Costs(fwd=1, bwd=1, wgrad=1), steps=5)
    >>> p.makespan, p.period
    (27, 24)

Every worker runs its list of step 1, then its list of step 2, and so on (:func:`repeat`: step j's micro-batches are
numbered after step j-1's), with what the step boundary waits for on top (:func:`boundaries`), in one of two modes:

* drained (``overlap=False``; what the runtime does today): a worker's optimizer step follows the global gradient
  norm, which needs every stage's gradients, so every worker's optimizer step (in a compute-only schedule, which
  has none: the next step's first action) waits until every worker has reached its own. The steps follow one
  another: the period is one step's makespan (which includes the optimizer step where the schedule is lowered).
* overlapped (``overlap=True``; Zero Bubble's post-validation: the global norm and the non-finite check are
  validated after the update, which is rolled back in the rare case they change it): a stage replica is updated
  as soon as the gradients of all of the stage's replicas are complete, and the next step's first compute of
  that stage on a worker waits for that and nothing more. Lowered, a replica's sum ends at its own
  ``ALLREDUCE_WAIT``, which the worker's list runs before the next step anyway; compute-only (the sum free), the
  gate is the last weight-gradient action of every other replica of the stage. A worker's optimizer action, where
  lowered, stays where its list has it (its stages' updates, costed once at the end of its step). The start-up of
  step j+1 on the workers that finish step j early overlaps the drain of the others.

The period is ``(E_k - E_1) / (k - 1)``, ``E_j`` the latest end of step j's actions: the mean length of the
steps after the first, which alone starts from an empty pipeline. With fixed lists the step ends grow, after a
short transient, by a fixed amount per step (or a fixed cycle of amounts), which this mean approaches as ``k``
grows; :attr:`StepTimes.last` is the last step's own length, to see whether the transient is over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from chimera.schedule.ir import Action, Schedule, _replace
from chimera.schedule.kinds import SPECS, Address, Res, Role
from chimera.schedule.simulate import Costs, Num, SimResult, Simulator


def repeat(schedule: Schedule, steps: int) -> Schedule:
    """``schedule``'s lists ``steps`` times over on each worker; step j's micro-batches of a pipe are numbered
    ``j * M`` on, ``M`` one past the pipe's highest number in one step."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if steps == 1:
        return schedule
    size: dict[str, int] = {}
    for row in schedule.actions:
        for a in row:
            if SPECS[a.kind].address is Address.MICROBATCH:
                size[a.pipe] = max(size.get(a.pipe, 0), a.microbatch + a.count)

    def shifted(a: Action, j: int) -> Action:
        if j == 0 or SPECS[a.kind].address is not Address.MICROBATCH:
            return a
        return replace(a, microbatch=a.microbatch + j * size[a.pipe])

    rows = [[shifted(a, j) for j in range(steps) for a in row] for row in schedule.actions]
    return _replace(schedule, actions=rows, microbatches=schedule.microbatches * steps,
                    name=f"{schedule.name} x{steps}")


def boundaries(schedule: Schedule, steps: int, overlap: bool) -> dict[int, tuple[int, ...]]:
    """The ordering edges between the steps of ``repeat(schedule, steps)`` (module docstring), as flat index ->
    the flat indices it waits for (:class:`~chimera.schedule.replay.Replay`'s ``after``)."""
    rows = schedule.actions
    base = [0]
    for row in rows:
        base.append(base[-1] + steps * len(row))

    def flat(w: int, j: int, i: int) -> int:
        return base[w] + j * len(rows[w]) + i

    gates: dict[int, tuple[int, ...]] = {}
    if not overlap:
        # where each worker's step ends: its optimizer step, else (not the last step) the next step's first action
        ends = {w: next((i for i, a in enumerate(row) if SPECS[a.kind].role is Role.UPDATE), len(row))
                for w, row in enumerate(rows) if row}
        for j in range(steps):
            for w, g in ends.items():
                if g == len(rows[w]) and j == steps - 1:
                    continue
                gates[flat(w, j, g)] = tuple(flat(v, j, e - 1) for v, e in ends.items() if v != w and e > 0)
        return {k: v for k, v in gates.items() if v}
    first: dict[tuple[int, str, int], int] = {}  # (worker, pipe, stage) -> its first compute in a step
    last: dict[tuple[int, str, int], int] = {}  # and its last action making weight gradients
    for w, row in enumerate(rows):
        for i, a in enumerate(row):
            if a.kind.is_compute:
                first.setdefault((w, a.pipe, a.stage), i)
            if Res.WGRAD in SPECS[a.kind].produces:
                last[(w, a.pipe, a.stage)] = i
    for (w, _, s), i in first.items():
        others = [(v, e) for (v, _, t), e in last.items() if t == s and v != w]
        for j in range(1, steps):
            if others:
                gates[flat(w, j, i)] = tuple(flat(v, j - 1, e) for v, e in others)
    return gates


@dataclass(frozen=True)
class StepTimes:
    """``steps`` consecutive steps simulated: ``ends[j]`` is the latest end of step j+1's actions; ``result`` the
    simulation of the repeated schedule (a timeline of all steps)."""

    steps: int
    overlap: bool
    ends: list[Num]
    result: SimResult

    @property
    def makespan(self) -> Num:
        """One step's makespan (the first step's end: it starts from an empty pipeline at 0)."""
        return self.ends[0]

    @property
    def period(self) -> Num:
        """``(E_k - E_1) / (k - 1)``: the mean length of a step after the first (module docstring)."""
        if self.steps < 2:
            raise ValueError("a period needs steps >= 2")
        d = self.ends[-1] - self.ends[0]
        return d / (self.steps - 1) if isinstance(d, float) else _exact(Fraction(d) / (self.steps - 1))

    @property
    def last(self) -> Num:
        """The last step's length ``E_k - E_(k-1)`` (one step's makespan where ``steps`` is 1)."""
        return self.ends[-1] - self.ends[-2] if self.steps > 1 else self.ends[0]


def _exact(x: Fraction) -> Num:
    return int(x) if x.denominator == 1 else x


def simulate_steps(schedule: Schedule, costs: Costs | None = None, steps: int = 5, overlap: bool = True
                   ) -> StepTimes:
    """``steps`` consecutive steps of ``schedule`` (compute-only or lowered) simulated with ``costs`` in the mode
    ``overlap`` (module docstring); ScheduleError on deadlock."""
    many = repeat(schedule, steps)
    r = Simulator(many, boundaries(schedule, steps, overlap)).run(costs)
    return StepTimes(steps, overlap, step_ends(r, [len(row) for row in schedule.actions], steps), r)


def step_ends(r: SimResult, lengths: Sequence[int], steps: int) -> list[Num]:
    """Per step, the latest end of its actions in ``r`` (a worker's actions end in list order, so its last one's)."""
    flat, unit = r._ends, r._unit  # noqa: SLF001  (one end per worker and step: not every end as a Fraction)
    out = []
    for j in range(steps):
        at, latest = 0, None
        for n in lengths:
            if n:
                e = flat[at + (j + 1) * n - 1]
                latest = e if latest is None or e > latest else latest
            at += steps * n
        latest = latest or 0
        out.append(_exact(Fraction(latest, unit)) if unit != 1 else latest)
    return out


def period(schedule: Schedule, costs: Costs | None = None, steps: int = 5, overlap: bool = True) -> StepTimes:
    """:func:`simulate_steps` with ``steps >= 2``: its ``period`` is the steady-state step length."""
    if steps < 2:
        raise ValueError(f"a period needs steps >= 2, got {steps}")
    return simulate_steps(schedule, costs, steps, overlap)

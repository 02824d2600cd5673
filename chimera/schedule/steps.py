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

* drained (``overlap=False``; what the runtime does with clipping without post-validation): a
  worker's optimizer step follows the global gradient norm, which needs every stage's gradients, so every worker's
  optimizer step (in a compute-only schedule, which has none: the next step's first action) waits until every
  worker has reached its own. The steps follow one
  another: the period is one step's makespan (which includes the optimizer step where the schedule is lowered).
* overlapped (``overlap=True``; what the runtime does when nothing syncs every worker at a step's end, and with
  post-validation (Zero Bubble's: the global norm and the non-finite check validated after the update, which is
  rolled back in the rare case they change it; ``chimera.runtime.post_validate``), where a worker's first stage
  update of step j+1 waits for every worker's VALIDATE of step j and nothing else): a stage replica is updated
  as soon as the gradients of all of the stage's replicas are complete, and the next step's first compute of
  that stage on a worker waits for that and nothing more. Lowered, a replica's sum ends at its own
  ``ALLREDUCE_WAIT``, which the worker's list runs before the next step anyway; compute-only (the sum free), the
  gate is the last weight-gradient action of every other replica of the stage, and (``tied``: a model's tied
  parameters, summed over the workers of their stages before either updates) of every replica of the stages tied
  to it. A worker's optimizer action, where
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

from chimera.schedule.fill import EQUAL, list_schedule
from chimera.schedule.ir import Action, Schedule, _replace
from chimera.schedule.kinds import SPECS, Address, Kind, Res, Role
from chimera.schedule.simulate import Costs, Num, SimResult, Simulator


def step_sizes(schedule: Schedule) -> dict[str, int]:
    """Per pipe, one past its highest micro-batch number in one step of ``schedule``: step j's micro-batches of the
    pipe are numbered ``j * size`` on in consecutive steps."""
    size: dict[str, int] = {}
    for row in schedule.actions:
        for a in row:
            if SPECS[a.kind].address is Address.MICROBATCH:
                size[a.pipe] = max(size.get(a.pipe, 0), a.microbatch + a.count)
    return size


def repeat(schedule: Schedule, steps: int) -> Schedule:
    """``schedule``'s lists ``steps`` times over on each worker; step j's micro-batches of a pipe are numbered
    ``j * M`` on, ``M`` one past the pipe's highest number in one step."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if steps == 1:
        return schedule
    size = step_sizes(schedule)

    def shifted(a: Action, j: int) -> Action:
        if j == 0 or SPECS[a.kind].address is not Address.MICROBATCH:
            return a
        return replace(a, microbatch=a.microbatch + j * size[a.pipe])

    rows = [[shifted(a, j) for j in range(steps) for a in row] for row in schedule.actions]
    return _replace(schedule, actions=rows, microbatches=schedule.microbatches * steps,
                    name=f"{schedule.name} x{steps}")


def deferred(schedule: Schedule, steps: int, costs: Costs = EQUAL) -> Schedule:
    """``steps`` consecutive steps of the compute-only, split-backward ``schedule`` ordered jointly by the
    zero-bubble list scheduler (:func:`chimera.schedule.fill.list_schedule` with ``step_size``): each worker takes
    ``schedule``'s forwards and input-gradient backwards as its preferred order (per stage group: a later one may
    go first when it can run and the earlier cannot; no memory limit), the overlapped step boundary as dependencies
    (a stage's next-step compute waits for its W on every replica, nothing else), and runs its oldest pending W
    wherever it would otherwise wait. So step j's W of one stage may run after step j+1's first forwards of another
    (Zero Bubble's post-validated steady state). Micro-batches are numbered as :func:`repeat` does; simulate it with
    :func:`simulate_steps` (``defer_w``). Simulator-only: the runtime runs one step's list at a time.

    Found at F = I = W, N = D (D = 8, 16; bench/RESULTS.md): no W actually crosses a boundary in the registry's
    candidates (each stage's W are the oldest pending when its next-step forward could start), so the joint order
    is one step's order repeated; what gains is that order itself: Chimera with backward halving, relisted so,
    repeats at 3N (its own list: 3N + D/4 - 1/2), holding D micro-batches of activations instead of D/2.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    kinds = {a.kind for row in schedule.actions for a in row}
    if schedule.lowered or Kind.W not in kinds or not kinds <= {Kind.F, Kind.I, Kind.W}:
        raise ValueError(f"{schedule.name}: deferring weight gradients across steps needs a compute-only schedule "
                         "with split backward (F, I and W only): build it with --split-backward")
    main = _replace(schedule, actions=[[a for a in row if a.kind is not Kind.W] for row in schedule.actions])
    rows = list_schedule(schedule.stages, schedule.placement, repeat(main, steps).actions, costs=costs, fifo=False,
                         step_size=step_sizes(schedule))
    return _replace(schedule, actions=rows, microbatches=schedule.microbatches * steps,
                    name=f"{schedule.name} x{steps} joint")


def _steps_of(many: Schedule, one: Schedule, steps: int, by_microbatch: bool) -> list[list[int]]:
    """The step of every action of ``many`` (consecutive steps of ``one``): by position where each worker runs
    its list of ``one`` step after step, else (:func:`deferred`) by micro-batch number."""
    if not by_microbatch:
        return [[j for j in range(steps) for _ in row] for row in one.actions]
    size = step_sizes(one)
    return [[a.microbatch // size[a.pipe] for a in row] for row in many.actions]


def boundaries(schedule: Schedule, steps: int, overlap: bool, _many: Schedule | None = None,
               tied: Sequence[Sequence[int]] = ()) -> dict[int, tuple[int, ...]]:
    """The ordering edges between the steps of ``repeat(schedule, steps)`` (or of ``_many``, its steps ordered
    jointly by :func:`deferred`) (module docstring), as flat index -> the flat indices it waits for
    (:class:`~chimera.schedule.replay.Replay`'s ``after``). ``tied``: groups of stages whose gradients are summed
    together (a model's tied parameters, e.g. ``((0, S - 1),)`` for an embedding tied to the output layer):
    overlapped, a stage's next-step compute also waits for the other stages' of its group, as for its replicas."""
    many = repeat(schedule, steps) if _many is None else _many
    step_of = _steps_of(many, schedule, steps, _many is not None)
    rows = many.actions
    base = [0]
    for row in rows:
        base.append(base[-1] + len(row))
    gates: dict[int, tuple[int, ...]] = {}
    if not overlap:
        # where each worker's step ends: its optimizer step, else (not the last step) the next step's first action
        one = schedule.actions
        ends = {w: next((i for i, a in enumerate(row) if SPECS[a.kind].role is Role.UPDATE), len(row))
                for w, row in enumerate(one) if row}
        for j in range(steps):
            for w, g in ends.items():
                if g == len(one[w]) and j == steps - 1:
                    continue
                gates[base[w] + j * len(one[w]) + g] = tuple(base[v] + j * len(one[v]) + e - 1
                                                             for v, e in ends.items() if v != w and e > 0)
        return {k: v for k, v in gates.items() if v}
    first: dict[tuple[int, str, int, int], int] = {}  # (worker, pipe, stage, step) -> its first compute
    last: dict[tuple[int, int], dict[int, int]] = {}  # (stage, step) -> worker -> its last action making weight grads
    for w, row in enumerate(rows):
        for i, a in enumerate(row):
            j = step_of[w][i]
            if a.kind.is_compute and j:
                first.setdefault((w, a.pipe, a.stage, j), base[w] + i)
            if Res.WGRAD in SPECS[a.kind].produces:
                last.setdefault((a.stage, j), {})[w] = base[w] + i
    group = {s: (s,) for s in range(schedule.stages)}
    for g in tied:
        for s in g:
            group[s] = tuple(sorted({*group[s], *g}))
    for (w, _, s, j), i in first.items():
        # the worker's own W came before in its list (a W deferred past its stage's update would deadlock here)
        others = tuple(e for t in group[s] for v, e in last.get((t, j - 1), {}).items() if v != w or _many is not None)
        if others:
            gates[i] = others
    _verdicts(rows, step_of, base, gates)
    return gates


def _verdicts(rows: Sequence[Sequence[Action]], step_of: Sequence[Sequence[int]], base: Sequence[int],
              gates: dict[int, tuple[int, ...]]) -> None:
    """Post-validated steps (a lowering with VALIDATE): a worker's first STAGE_UPDATE of step j takes step j-1's
    verdict, so it waits for every worker's VALIDATE of step j-1 (the norm's allreduce)."""
    validates: dict[int, list[int]] = {}
    first_update: dict[tuple[int, int], int] = {}
    for w, row in enumerate(rows):
        for i, a in enumerate(row):
            if a.kind is Kind.VALIDATE:
                validates.setdefault(step_of[w][i], []).append(base[w] + i)
            elif a.kind is Kind.STAGE_UPDATE:
                first_update.setdefault((w, step_of[w][i]), base[w] + i)
    for (_, j), i in first_update.items():
        if j and validates.get(j - 1):
            gates[i] = (*gates.get(i, ()), *validates[j - 1])


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


def simulate_steps(schedule: Schedule, costs: Costs | None = None, steps: int = 5, overlap: bool = True,
                   defer_w: bool = False, tied: Sequence[Sequence[int]] = ()) -> StepTimes:
    """``steps`` consecutive steps of ``schedule`` (compute-only or lowered) simulated with ``costs`` in the mode
    ``overlap`` (module docstring); ScheduleError on deadlock. ``defer_w``: the steps ordered jointly, W
    deferred across step boundaries (:func:`deferred`, ordered with ``costs``; overlapped boundary only);
    ``tied``: stages summed together (:func:`boundaries`)."""
    if defer_w:
        if not overlap:
            raise ValueError("deferring weight gradients across steps needs the overlapped step boundary "
                             "(overlap=True): a drained step ends with every W")
        many = deferred(schedule, steps, costs or Costs())
    else:
        many = repeat(schedule, steps)
    r = Simulator(many, boundaries(schedule, steps, overlap, many if defer_w else None, tied)).run(costs)
    return StepTimes(steps, overlap, step_ends(r, _steps_of(many, schedule, steps, defer_w), steps), r)


def step_ends(r: SimResult, step_of: Sequence[Sequence[int]], steps: int) -> list[Num]:
    """Per step, the latest end of its actions in ``r`` (``step_of[w][i]``: the step of worker w's action i)."""
    flat, unit = r._ends, r._unit  # noqa: SLF001  (the latest per step, then as a Fraction: not every end)
    latest: list[Num] = [0] * steps
    at = 0
    for row in step_of:
        for i, j in enumerate(row):
            e = flat[at + i]
            if e > latest[j]:
                latest[j] = e
        at += len(row)
    return [_exact(Fraction(e, unit)) if unit != 1 else e for e in latest]


def period(schedule: Schedule, costs: Costs | None = None, steps: int = 5, overlap: bool = True,
           defer_w: bool = False, tied: Sequence[Sequence[int]] = ()) -> StepTimes:
    """:func:`simulate_steps` with ``steps >= 2``: its ``period`` is the steady-state step length."""
    if steps < 2:
        raise ValueError(f"a period needs steps >= 2, got {steps}")
    return simulate_steps(schedule, costs, steps, overlap, defer_w, tied)

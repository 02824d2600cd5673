"""The fastest schedule for (D, N): simulate every schedule the runtime can run there, keep the fastest that fits.

Usage::

    >>> from chimera.schedule import Costs
    >>> from chimera.schedule.best import best
    >>> choice, ranked = best(8, 16, Costs(fwd=1, bwd=1, wgrad=1))
    >>> choice.label, float(choice.bubble) < 0.06
    ('chimera --mode halving --split-backward', True)

Costs are those of one worker's share of the model (the model split D ways): a schedule with v stages per
worker and pipe (interleaved) charges each of its D*v stages 1/v of them. As the runtime runs a split
backward, the first stage's input-gradient part costs nothing and its weight-gradient part its whole backward
(``Costs.first_stage_whole_backward``); the zero-bubble list scheduler orders with those per-stage costs.
``memory_limit`` bounds a worker's memory in micro-batches of activations: its peak activations (the
simulator's ``peak_activations``) plus ``weight_memory`` (one share of the model's parameters, gradients and
optimizer state, in the same unit) times the shares it holds (``Choice.shares``: 1 for 1F1B, 2 for Chimera,
4 for four-pipe Chimera). 1F1B is always a candidate, so the choice is never slower than 1F1B when 1F1B fits.
Training's ``auto`` prices the candidates in bytes instead (the compiler's memory pass) and marks those over the
budget with :func:`exclude`. The candidates are the registry's (:func:`chimera.schedule.registry.candidates`).

``steps`` >= 2 also simulates that many consecutive steps of each candidate with the overlapped step boundary
(:mod:`chimera.schedule.steps`: each stage updated as soon as its own gradients are summed) and gives its
steady-state ``period``; ``by="period"`` ranks by it (default: by one step's makespan, as the planner and
training's ``auto`` do), and adds, for each split-backward candidate that could beat the best period found, its
steps ordered jointly by the list scheduler, weight gradients free to cross step boundaries
(:func:`chimera.schedule.steps.deferred`; label ``... +joint steps``): simulator-only, the runtime runs each step's
list as it is; ``joint=False`` leaves them out (a pick that a job is to run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from chimera.schedule.ir import Schedule, ScheduleConfigError
from chimera.schedule.registry import build_schedule, candidates
from chimera.schedule.simulate import Costs, Num, SimResult, peak_activations, simulate
from chimera.schedule.steps import period as steps_period

RANK_BY = ("makespan", "period")


@dataclass(frozen=True)
class Choice:
    """One simulated candidate: its flags (``label``), build options, makespan, bubble, peak activations, the
    shares of the model a worker holds, whether it fits (and if not, ``over``: by how much), the schedule, and
    (where asked for) the steady-state period of consecutive overlapped steps.

    ``deferred``: the candidate's steps ordered jointly, W free to cross step boundaries (module docstring);
    then ``makespan`` is the first step's end (its deferred W included), ``bubble`` the steady state's
    (1 - busy / (workers * period)), ``peak`` that of the joint order, and ``schedule`` the one-step schedule."""

    label: str
    name: str
    options: dict[str, Any] = field(compare=False)
    makespan: Num = 0
    bubble: Num = 0
    peak: Num = 0
    fits: bool = True
    shares: Num = 1
    over: str = ""
    schedule: Schedule | None = field(default=None, compare=False, repr=False)
    period: Num | None = None
    deferred: bool = False


def per_stage(costs: Costs, chunks: int) -> Costs:
    """``costs`` of one worker's share, for a pipe of D*chunks stages (each 1/chunks of a share)."""
    if chunks == 1:
        return costs

    def split(v: Any) -> Any:
        if isinstance(v, Sequence):
            return [split(v[s // chunks]) for s in range(len(v) * chunks)]
        return Fraction(v, chunks) if isinstance(v, int | Fraction) else v / chunks

    return dataclasses.replace(costs, fwd=split(costs.fwd), bwd=split(costs.bwd), wgrad=split(costs.wgrad),
                               allreduce=split(costs.allreduce))


def _num(x: Num) -> Num:
    return int(x) if x == int(x) else x


#: for a candidate's stage count, the groups of stages whose gradients are summed together (tied parameters)
TiedStages = Callable[[int], Sequence[Sequence[int]]]


def rank(stages: int, microbatches: int, costs: Costs, memory_limit: Num | None = None,
         halving: bool = True, layers: int | None = None, weight_memory: Num = 0, steps: int = 1,
         by: str = "makespan", sharded_memory: Num = 0, joint: bool = True, tied: TiedStages | None = None
         ) -> list[Choice]:
    """Every candidate simulated with ``costs``; those that fit first, fastest first (then least memory).
    ``layers``: leave out candidates with more stages than the model has layers. ``steps`` >= 2: each also gets
    its period over that many overlapped steps; ``by``: rank by ``makespan`` or ``period`` (which needs it).
    ``sharded_memory``: the part of ``weight_memory`` that is optimizer state sharded over each stage's replicas
    (``--shard-optimizer``; :func:`owned_shares`). ``joint``: by ``period``, add the simulator-only jointly ordered
    variants (module docstring). ``tied``: a model's tied stages, which the period's step boundary waits for as
    for a stage's replicas (``chimera.schedule.steps.boundaries``)."""
    _check_by(by, steps)
    out, split_ones = [], []
    for label, spec, options in candidates(stages, microbatches, halving, steady=by == "period"):
        chunks = spec.chunks_of(options)
        if layers is not None and spec.parts(stages, options) > layers:
            continue
        split = per_stage(costs, chunks).first_stage_whole_backward(stages * chunks)
        options = {**options, "order_costs": split}  # zero-bubble orders: with the stages' own costs
        try:
            s = build_schedule(spec.name, stages, microbatches, **options)
        except ScheduleConfigError:
            continue
        r = simulate(s, split)
        peak, shares = footprint(s, chunks, r.peak_activations)
        over = _over(s, chunks, peak, shares, memory_limit, weight_memory, sharded_memory)
        groups = tied(s.stages) if tied is not None else ()
        per = steps_period(s, split, steps, tied=groups).period if steps > 1 else None
        out.append(Choice(label, spec.name, options, r.makespan, r.bubble, peak, not over, shares, over, s, per))
        if by == "period" and joint and not groups and s.splits_backward:
            split_ones.append((out[-1], split, r, chunks))  # (joint orders: untied models only)
    limits = (memory_limit, weight_memory, sharded_memory)
    return _sorted(out + (_deferred(out, split_ones, steps, limits) if split_ones else []), by)


def _over(s: Schedule, chunks: int, peak: Num, shares: Num, memory_limit: Num | None, weight_memory: Num,
          sharded_memory: Num) -> str:
    """By how much a worker of ``s`` holding ``peak`` and ``shares`` exceeds ``memory_limit`` ("" if it fits)."""
    need = peak + weight_memory * shares
    if sharded_memory:  # each replica keeps only its part of the stage's optimizer state
        need -= sharded_memory * (shares - owned_shares(s, chunks))
    return "" if memory_limit is None or need <= memory_limit else f"needs {float(need):g}"


def _deferred(ranked: Sequence[Choice], split_ones: Sequence[tuple[Choice, Costs, SimResult, int]], steps: int,
              limits: tuple[Num | None, Num, Num]) -> list[Choice]:
    """The jointly ordered variants (module docstring) of the split-backward candidates ``split_ones``, fastest period
    first, each only while it could beat the best period that fits so far: no order's period is under its
    busiest worker's compute per step."""
    fitting = [c.period for c in ranked if c.fits]
    top = min(fitting) if fitting else None
    out = []
    for c, split, r, chunks in sorted(split_ones, key=lambda x: x[0].period):
        if top is not None and max(r.busy) >= top:
            continue
        p = steps_period(c.schedule, split, steps, defer_w=True)
        peak, _ = footprint(p.result.schedule, chunks)
        over = _over(c.schedule, chunks, peak, c.shares, *limits)
        bubble = 1 - Fraction(sum(Fraction(b) for b in r.busy)) / (len(r.busy) * Fraction(p.period))
        out.append(dataclasses.replace(c, label=f"{c.label} +joint steps", makespan=p.makespan, bubble=_num(bubble),
                                       peak=peak, fits=not over, over=over, period=p.period, deferred=True))
        if not over and (top is None or p.period < top):
            top = p.period
    return out


def footprint(schedule: Schedule, chunks: int, peaks: Sequence[Num] | None = None) -> tuple[Num, Num]:
    """What a worker of ``schedule`` holds at most, in the unit of :func:`rank`'s memory limit: its peak
    activations (micro-batches of one share; a stage of a D*chunks pipe holds 1/chunks of one) and the shares of
    the model (weights, gradients, optimizer state) it keeps. ``peaks``: the per-worker peaks when simulated
    already. Any schedule in the IR is priced so, a torch.pp order read with ``from_csv`` too."""
    peaks = peak_activations(schedule) if peaks is None else peaks
    peak = _num(Fraction(max(peaks)) / chunks)
    shares = _num(Fraction(max(len(schedule.stages_of(w)) for w in range(schedule.workers)), chunks))
    return peak, shares


def owned_shares(schedule: Schedule, chunks: int) -> Num:
    """The shares of the model's optimizer state a worker keeps when each stage's state is sharded over its replicas
    (ZeRO-1): per stage held, 1/chunks of a share split over the stage's group (both pipes, every data-parallel
    group): Chimera and four-pipe Chimera keep one share, as 1F1B."""
    return _num(max(sum(Fraction(1, chunks * schedule.stage_group_size(st)) for _, st in schedule.stages_of(w))
                    for w in range(schedule.workers)))


def _check_by(by: str, steps: int) -> None:
    if by not in RANK_BY:
        raise ValueError(f"rank by one of {', '.join(RANK_BY)}, got {by!r}")
    if by == "period" and steps < 2:
        raise ValueError(f"ranking by period needs steps >= 2 (consecutive steps simulated), got {steps}")


def _sorted(choices: Sequence[Choice], by: str = "makespan") -> list[Choice]:
    # ties (equal to 1e-9, so that float costs' rounding decides none): the simpler schedule (no split backward),
    # then the least memory (by period: the shorter makespan first)
    return sorted(choices, key=lambda c: (not c.fits, _tied(c.period if by == "period" else c.makespan),
                                          _tied(c.makespan), c.options.get("split_backward", False), c.peak, c.shares))


def _tied(x: Num | None) -> float:
    return round(float(x), 9) if x is not None else float("inf")


def exclude(ranked: Sequence[Choice], over: dict[str, str], by: str = "makespan") -> list[Choice]:
    """``ranked`` with the candidates named in ``over`` (label -> by how much) marked as not fitting."""
    return _sorted([dataclasses.replace(c, fits=False, over=over[c.label]) if c.label in over else c for c in ranked],
                   by)


def best(stages: int, microbatches: int, costs: Costs, memory_limit: Num | None = None,
         halving: bool = True, layers: int | None = None, weight_memory: Num = 0, steps: int = 1,
         by: str = "makespan", sharded_memory: Num = 0, joint: bool = True, tied: TiedStages | None = None
         ) -> tuple[Choice, list[Choice]]:
    """The fastest candidate that fits (by one step's ``makespan``, or by the ``period`` of ``steps`` consecutive
    overlapped steps; ``joint``, ``tied``: as :func:`rank`), and the whole ranking; ScheduleConfigError when none
    fits."""
    ranked = rank(stages, microbatches, costs, memory_limit, halving, layers, weight_memory, steps, by, sharded_memory,
                  joint, tied)
    if not ranked:
        few = f": the model has {layers} layers, fewer than the {stages} stages; lower --stages" if layers else ""
        raise ScheduleConfigError(f"no schedule builds for D={stages}, N={microbatches}{few}")
    if not ranked[0].fits:
        least = min((c.peak + weight_memory * c.shares - sharded_memory * (c.shares - owned_shares(
            c.schedule, c.schedule.stages // stages)) for c in ranked if c.schedule is not None), default=None)
        raise ScheduleConfigError(f"no schedule for D={stages}, N={microbatches} fits --memory-limit {memory_limit} "
                                  f"micro-batches of activations per worker (weights included at --weight-memory "
                                  f"{weight_memory} per share); the least any needs is {least}: raise the limit, "
                                  "or lower --weight-memory")
    return ranked[0], ranked


def explain(choice: Choice, ranked: Sequence[Choice], by: str = "makespan") -> str:
    """Why ``choice``: its figures against 1F1B's and the runner-up's (by ``makespan`` or ``period``)."""
    ref = next(c for c in ranked if c.label == "1f1b")
    others = [c for c in ranked if c.fits and c is not choice]

    def fig(c: Choice) -> Num:
        return c.period if by == "period" else c.makespan

    also = f", period {float(choice.period):g}" if choice.period is not None and by != "period" else ""
    head = (f"makespan {float(choice.makespan):g}{also}" if by != "period"
            else f"period {float(fig(choice)):g}, makespan {float(choice.makespan):g}")
    why = (f"auto: {choice.label}: {head} (bubble {float(choice.bubble):.3f}, peak {float(choice.peak):g} "
           f"micro-batches), {float(fig(ref) / fig(choice)):.3f}x as fast as 1f1b ({float(fig(ref)):g})")
    if others:
        why += f"; next: {others[0].label} ({float(fig(others[0])):g})"
    skipped = [f"{c.label} ({c.over})" if c.over else c.label for c in ranked if not c.fits]
    if skipped:
        why += f"; over the memory limit: {', '.join(skipped)}"
    return why


def ranking(choice: Choice, ranked: Sequence[Choice], by: str = "makespan") -> dict[str, Any]:
    """JSON-ready: the choice, why, what it is ranked by, and every candidate's figures (``period`` where
    simulated)."""
    return {"choice": choice.label, "why": explain(choice, ranked, by), "by": by, "candidates": [
        {"schedule": c.label, "makespan": float(c.makespan), **({} if c.period is None else {"period": float(c.period)}),
         "bubble": float(c.bubble), "peak": float(c.peak), "shares": float(c.shares), "fits": c.fits,
         **({"over": c.over} if c.over else {})} for c in ranked]}


def table(choice: Choice, ranked: Sequence[Choice], by: str = "makespan") -> str:
    """One line per candidate (its period where simulated), then why the choice."""
    periods = any(c.period is not None for c in ranked)
    wide = max([42, *(len(c.label) for c in ranked)])
    lines = [f"{'schedule':<{wide}} {'makespan':>9}{' period' if periods else ''} {'bubble':>7} {'peak':>5} "
             f"{'shares':>6}"]
    lines += [f"{c.label:<{wide}} {float(c.makespan):>9g}{_cell(c.period) if periods else ''} {float(c.bubble):>7.3f} "
              f"{float(c.peak):>5g} {float(c.shares):>6g}"
              f"{'' if c.fits else '  over the memory limit: ' + (c.over or '')}" for c in ranked]
    return "\n".join([*lines, explain(choice, ranked, by)])


def _cell(period: Num | None) -> str:
    return f" {'-' if period is None else format(float(period), 'g'):>6}"

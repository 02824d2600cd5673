"""The planner's candidates ranked by the steady state's period, where the runtime overlaps consecutive steps.

A run that waits for no global gradient norm at a step's end (``--clip-grad 0``, or ``--post-validate``, which
takes the norm's verdict during the next step) overlaps consecutive steps: a worker starts its next step as soon
as its own list allows, and what the run measures is the period of the steady state, not one step's makespan
(``chimera.schedule.steps``). :func:`by_period` re-prices candidates so: each on its own partition, its lowered
schedule (post-validated where asked) simulated for :data:`STEADY_STEPS` steps with the profile's costs, a tied
model's ends holding the boundary as a stage's replicas do (:func:`tied_stages`)::

    result = plan(profile, workers=2, clip=False)
    ranked = by_period(result.ranked[:10], profile, "lamb", clip=False, post_validated=False)

Used by ``chimera plan`` (its top rows) and training's profiled ``auto``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from chimera.offload.lowering import lower
from chimera.plan.candidate import Candidate, Evaluated
from chimera.plan.costs import simulator_costs
from chimera.plan.partition import layers_of
from chimera.profile import Profile
from chimera.schedule.registry import cached_build
from chimera.schedule.steps import period

#: consecutive steps simulated to find the steady state's period
STEADY_STEPS = 6
#: the most compute actions per step (summed over the candidates) that ``chimera plan`` re-prices by the period:
#: about 0.12 ms each for 6 lowered steps on the development machine, so about 2.5 s at most
PERIOD_BUDGET = 20_000


def compute_actions(c: Candidate) -> int:
    """About how many compute actions one step of ``c`` runs (F, B or F, I, W per stage part and micro-batch)."""
    return c.stages * c.chunks * c.micro_batches * (3 if c.split_backward else 2)


def affordable(ranked: Sequence[Evaluated], budget: int | None = None) -> bool:
    """Whether re-pricing ``ranked`` by the period stays within ``budget`` (default :data:`PERIOD_BUDGET`) compute
    actions per step in all."""
    return sum(compute_actions(e.candidate) for e in ranked) <= (PERIOD_BUDGET if budget is None else budget)


def tied_stages(pairs: Sequence[tuple[int, int]], stage_layers: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The groups of stages whose gradients are summed together: the stages of each tied pair of layers ``pairs``
    under the split ``stage_layers`` (a pair on one stage is one parameter there: no group)."""
    stage_of = {i: s for s, layers in enumerate(stage_layers) for i in layers}
    return sorted({tuple(sorted({stage_of[a], stage_of[b]})) for a, b in pairs if stage_of[a] != stage_of[b]})


def steps_overlap(clip: bool, post_validated: bool) -> bool:
    """Whether the runtime overlaps consecutive steps: no global norm waited for at a step's end (no clipping, or
    clipping post-validated). Tied weights hold only the workers of their ends, which the period models."""
    return not clip or post_validated


def by_period(ranked: Sequence[Evaluated], profile: Profile, optimizer: str, clip: bool, post_validated: bool,
              steps: int = STEADY_STEPS) -> list[Evaluated]:
    """``ranked`` (feasible candidates with their partitions), each with ``step_s`` (and ``samples_per_s``) the
    period of ``steps`` overlapped steps of its lowered schedule priced with ``profile``, fastest first (ties keep
    the given order); every one simulated (``exact``)."""
    out = []
    for e in ranked:
        c = e.candidate
        assert e.partition is not None and e.step_s is not None
        layers = layers_of(e.partition)
        # the planner's own build where it made one (chimera plan prunes with the registry's build cache)
        sched = cached_build(c.schedule, c.stages, c.micro_batches, chunks=c.chunks, mode=c.mode,
                             data_parallel=c.data_parallel, split_backward=c.split_backward)
        costs = simulator_costs(profile, layers, c.unit, c.recompute, sched, optimizer, c.offload, clip)
        pairs = [(i, j) for s in layers for i in s for j in profile.layers[i].tied]
        step = float(period(lower(sched, c.offload, post_validated), costs, steps,
                            tied=tied_stages(pairs, layers)).period)
        samples = (e.samples_per_s or 0.0) * e.step_s
        out.append(replace(e, step_s=step, samples_per_s=samples / step if step > 0 else float("inf"), exact=True))
    return sorted(out, key=lambda e: e.step_s)

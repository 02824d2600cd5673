"""The planner's lower bound: seconds below every estimate a candidate can get, from its frame (no order built).

The planner estimates a candidate on its load-balanced partition (:func:`chimera.plan.partition.balanced`, one per
recomputation setting: ``plan_partition``'s first pass starts and, with no rounds, stays there) as either

* the compute-only makespan plus the largest stage's gradient sum and the optimizer step (as it is, or
  recomputing), or
* the lowered schedule's makespan (offloaded; the lowering starts a stage replica's gradient sum after its last
  backward on the worker and waits for it before the optimizer step),

with costs that recomputation, offload and packs only raise. The simulator's makespan is at least, on every worker,
``reach + drain`` (:func:`chimera.schedule.simulate.worker_bounds`: the earliest its last compute action can end,
and the chain of backwards that must follow it), whatever the order; in a lowered schedule the gradient sum of the
stage of a worker's last backward follows it too (at least the least of its stages' sums). So:

* where the candidate surely fits as it is (no memory limit, or :func:`chimera.plan.memory.memory_ceiling`
  within it: no recomputing or offloaded variant is then tried), its estimate is at least
  ``max(reach + drain) + max(gradient sum)``;
* else at least the least, with and without recomputation, of ``max(reach + max(drain, least gradient sum of the
  worker's stages))``.

Less a relative 1e-9: the simulator adds the same float terms in another order.
"""

from __future__ import annotations

from typing import Any

from chimera.plan.costs import simulator_costs
from chimera.plan.memory import memory_ceiling
from chimera.plan.partition import balanced, layers_of
from chimera.profile import Profile
from chimera.schedule import Schedule
from chimera.schedule.simulate import worker_bounds

#: what the bound gives up so that float rounding cannot lift it above the simulated figure
SLACK = 1e-9


def lower_bound(profile: Profile, frame: Schedule, unit: int, whole_backward: bool, memory_limit: int | None,
                optimizer: str, exchange: bool) -> float:
    """Seconds no estimate of the candidate with this frame (:func:`chimera.schedule.registry.frame_schedule`),
    unit and backward form can beat, as it is or recomputing or offloaded (module docstring)."""
    return bound_and_fit(profile, frame, unit, whole_backward, memory_limit, optimizer, exchange)[0]


def bound_and_fit(profile: Profile, frame: Schedule, unit: int, whole_backward: bool, memory_limit: int | None,
                  optimizer: str, exchange: bool, post_validated: bool = False) -> tuple[float, bool]:
    """:func:`lower_bound`, and whether the candidate surely fits as it is (no memory limit, or
    :func:`chimera.plan.memory.memory_ceiling` within it, post-validated steps' rollback copies included when
    ``post_validated``): then no recomputing or offloaded variant is tried, and its first estimate is its least."""
    sizes = balanced(profile, frame, unit, False)
    if memory_limit is None or memory_ceiling(profile, frame, layers_of(sizes), unit, optimizer, exchange,
                                              post_validated) <= memory_limit:
        return _bound(profile, frame, unit, False, whole_backward, lowered=False) * (1 - SLACK), True
    return min(_bound(profile, frame, unit, recompute, whole_backward, lowered=True)
               for recompute in (False, True)) * (1 - SLACK), False


def frame_key(frame: Schedule) -> tuple[Any, ...]:
    """What :func:`lower_bound` reads of a frame, as a key: every field a schedule compares by but its (empty)
    actions, and its number of workers. Candidates whose frames share it (1F1B, GPipe, ZB-H1 and ZB-H2 at one D
    and N, say) share their bound for a unit and backward form."""
    return (frame.stages, frame.microbatches, tuple(frame.placement.items()), frame.data_parallel,
            frame.microbatch_scale, frame.lowered, frame.workers)


def _bound(profile: Profile, frame: Schedule, unit: int, recompute: bool, whole_backward: bool,
           lowered: bool) -> float:
    layers = layers_of(balanced(profile, frame, unit, recompute))
    costs = simulator_costs(profile, layers, unit, recompute, frame)
    sums = [costs.stage_value(costs.allreduce, s) for s in range(frame.stages)]
    bounds = worker_bounds(frame, costs, whole_backward)
    if not lowered:
        return float(max(reach + drain for reach, drain in bounds) + max(sums, default=0.0))
    return float(max(reach + max(drain, min(sums[s] for _, s in frame.stages_of(w)))
                     for w, (reach, drain) in enumerate(bounds)))

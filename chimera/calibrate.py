"""The runtime's own time per action: what a forward, a backward or its parts cost beyond their layers' compute.

A layer profile times each layer alone; the runtime also dispatches the action, runs the stage's Python, seeds,
stashes and hands the output over. :func:`measure_action_costs` runs the runtime itself (one process per worker,
as training does) on the delay model with zero sleeps, whose blocks compute next to nothing, records every
action's interval, and keeps per compute kind the median: that is the fixed cost the simulator charges per action
(``Costs.fixed``)::

    fixed = measure_action_costs(workers=2)      # {"F": 2.1e-4, "B": 3.0e-4, "I": ..., "W": ...}
    costs = replace(costs, fixed=tuple(fixed.items()))

What a step pays once beyond its actions (:func:`step_remainder` of :func:`measure_runtime`'s runs) is the rest of
the runtime's own time; ``chimera profile --comm local`` records both (``Profile.actions``, ``Profile.step_s``).

With ``sleep_s`` > 0 every block sleeps that long (forward, input gradient and weight gradient each) and an action's
fixed cost is its interval less its sleeps: a worker that sleeps (waits on a device, or on the delay model's timer)
pays more per action than one that never does (the wake-up, the cold caches: about 0.6 ms against 0.2 ms on the
2-core development machine at 10-25 ms sleeps), so measure with sleeps like the actions to be predicted.

Communication's own worker time is the comm profile's (``p2p_busy``, the ping-pong's fixed cost on the runtime's
p2p), not measured here. The figure depends on the machine and its load: measure as training will run (as many
workers at once on the machine).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from chimera.schedule import Action, Costs, Kind, Schedule

if TYPE_CHECKING:
    from chimera.job import Job
    from chimera.runtime.launch import LocalResult

#: the kinds measured: the compute kinds of a whole and a split backward
KINDS = ("F", "B", "I", "W")


def measure_action_costs(workers: int = 2, steps: int = 12, skip: int = 4, micro_batches: int | None = None,
                         device: str = "cpu", sleep_s: float = 0.0) -> dict[str, float]:
    """Median seconds per action of each compute kind (:data:`KINDS`) beyond its sleeps over the recorded steps
    (:func:`measure_runtime`) of 1F1B with a whole and with a split backward on ``workers`` workers, the delay
    model sleeping ``sleep_s`` per block (module docstring)."""
    return measure_runtime(workers, steps, skip, micro_batches, device, sleep_s)[0]


def measure_runtime(workers: int = 2, steps: int = 12, skip: int = 4, micro_batches: int | None = None,
                    device: str = "cpu", sleep_s: float = 0.0, launch: Callable[[Job], LocalResult] | None = None
                    ) -> tuple[dict[str, float], list[tuple[Schedule, float]]]:
    """:func:`measure_action_costs`, and per job run (1F1B whole and split) its lowered schedule and the median
    seconds of its last steps, which record nothing and follow a step that recorded nothing (a recording step runs
    slower, and consecutive steps overlap: the one after it starts late): what a step costs beyond its actions (and
    their sleeps, :func:`sleeps`) is what those steps take beyond their simulation. Steps ``skip`` to ``skip + (steps
    - skip) // 2 - 1`` record their actions, one more is left out, the rest are timed. ``launch`` runs each job and
    returns its records and events (default :func:`~chimera.runtime.run_local`): measure on the launcher whose steps
    are to be predicted (a Ray actor's step costs more than a local process's)."""
    from chimera.compile import compile_job
    from chimera.config import TrainConfig
    from chimera.runtime.launch import run_local

    if workers < 2 or steps < skip + 3:
        raise ValueError(f"need workers >= 2 and steps >= skip + 3, got workers={workers}, steps={steps}, skip={skip}")
    recorded = tuple(range(skip, skip + (steps - skip) // 2))
    if sleep_s < 0:
        raise ValueError(f"sleep_s is seconds per block, >= 0; got {sleep_s}")
    n = micro_batches or 2 * workers
    slept = sleeps(sleep_s, workers)
    durations: dict[str, list[float]] = defaultdict(list)
    runs: list[tuple[Schedule, float]] = []
    for split in (False, True):
        cfg = TrainConfig.from_flags(model="delay", model_overrides={"num_blocks": workers, "fwd_s": sleep_s},
                                     schedule="1f1b", split_backward=split, stages=workers, micro_batches=n,
                                     micro_batch_size=2, steps=steps, optimizer="sgd", lr=1e-3, clip_grad=0.0,
                                     threads=1, device=device, corpus="synthetic", partition="uniform", profile=True,
                                     profile_steps=recorded)
        job = compile_job(cfg)
        result = (launch or run_local)(job)
        for e in result.events:
            if e.kind in KINDS:
                a = Action(Kind(e.kind), e.pipe, e.stage, e.microbatch, e.count)
                durations[e.kind].append(e.end - e.start - float(slept.of(a)))
        timed = [m["step_time_s"] for m in result.metrics[recorded[-1] + 2:]]
        runs.append((job.schedule, statistics.median(timed)))
    return {k: statistics.median(durations[k]) for k in KINDS if durations[k]}, runs


def step_remainder(runs: list[tuple[Schedule, float]], costs: Callable[[Schedule], Costs]) -> float:
    """What a step costs beyond its actions: the median, over :func:`measure_runtime`'s ``runs`` (each job's lowered
    schedule and its measured step), of the step less its simulation with ``costs(schedule)`` (the blocks' sleeps, the
    fixed time per action and whatever else the caller prices: then not counted twice); 0 where the simulation is
    longer. Dispatching the step, its record, collecting its garbage and whatever else a step pays once: the
    planner charges it to the optimizer step."""
    from chimera.schedule import simulate

    extra = [step - float(simulate(s, costs(s)).makespan) for s, step in runs]
    return max(0.0, statistics.median(extra)) if extra else 0.0


def runtime_costs(workers: int, device: str = "cpu", p2p_s: float = 0.0) -> tuple[dict[str, float], float]:
    """The runtime's own time on ``workers`` local workers: per compute action by kind
    (:func:`measure_runtime`) and per step beyond its actions (:func:`step_remainder`, the messages priced at
    ``p2p_s`` each way and of worker time, as the planner prices them with a profile's p2p link), as
    ``chimera profile --comm local`` records them (``Profile.actions``, ``Profile.step_s``)."""
    from dataclasses import replace

    fixed, runs = measure_runtime(workers, steps=16, skip=3, device=device)

    def costs(s: Schedule) -> Costs:
        return replace(sleeps(0.0, s.stages), fixed=tuple(fixed.items()), p2p_latency=p2p_s, p2p_busy=p2p_s)

    return fixed, step_remainder(runs, costs)


def sleeps(sleep_s: float, workers: int) -> Costs:
    """What the delay model sleeps per action when every block sleeps ``sleep_s`` (one block per stage): forward,
    input gradient and weight gradient each, except that the first stage's inputs need no gradient, so its weight
    gradient sleeps both (:meth:`Costs.first_stage_whole_backward`)."""
    return Costs(fwd=sleep_s, bwd=sleep_s, wgrad=sleep_s).first_stage_whole_backward(workers)

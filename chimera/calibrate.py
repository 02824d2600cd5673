"""The runtime's own time per action: what a forward, a backward or its parts cost beyond their layers' compute.

A layer profile times each layer alone; the runtime also dispatches the action, runs the stage's Python, seeds,
stashes and hands the output over. :func:`measure_action_costs` runs the runtime itself (one process per worker,
as training does) on the delay model with zero sleeps, whose blocks compute next to nothing, records every
action's interval, and keeps per compute kind the median (the mean of its two jobs' medians): that is the fixed cost
the simulator charges per action (``Costs.fixed``)::

    fixed = measure_action_costs(workers=2)      # {"F": 2.1e-4, "B": 3.0e-4, "I": ..., "W": ...}
    costs = replace(costs, fixed=tuple(fixed.items()))

A send costs its worker more than a receive whose message is there (on shared memory it copies the message in
and wakes its peer: ~0.08 ms against ~0.03 ms on the 2-core development machine): beyond the comm profile's
``p2p_busy`` (the ping-pong's one-way time, charged to every send and receive) each send kind gets a fixed time
too, measured on the batches that hold sends alone (:func:`send_times`; in a batch with a receive it may have
waited for its peer). Charging every send and receive the lower quartile of its kind's intervals instead (a
receive's hold waits) had 1F1B at tf = 0.5 ms, D = 4, N = 8 (whose steady state posts every send with a receive)
predicted 6 % long; without the sends' time, 4 % short at 2 ms.

A gradient sum over a stage's replicas costs its workers too: its start flattens the gradients and posts them, its
wait adds the peer's bucket and unflattens the sum (~0.04 ms each on the 2-core development machine with the delay
model at tf = 0, the start ~0.09 ms with 2 ms sleeps). 1F1B has no replicas, so :func:`measure_runtime` also runs
Chimera (every stage on two workers) for a few steps and gives each kind of :data:`SYNCS` its fixed time
(:func:`sync_times`): the start beyond ``p2p_s`` (the busy time the simulator charges it already), the wait from
when the peer's bucket could have arrived.

What a step pays once beyond its actions (:func:`step_remainder` of :func:`measure_runtime`'s runs) is the rest of
the runtime's own time; ``chimera profile --comm local`` records both (``Profile.actions``, ``Profile.step_s``).

With ``sleep_s`` > 0 every block sleeps that long (forward, input gradient and weight gradient each) and an action's
fixed cost is its interval less its sleeps: a worker that sleeps (waits on a device, or on the delay model's timer)
pays more per action than one that never does (the wake-up, the cold caches: about 0.6 ms against 0.2 ms on the
2-core development machine at 10-25 ms sleeps), so measure with sleeps like the actions to be predicted.

The figures depend on the machine and its load: measure as training will run (as many workers at once on the
machine). Where workers share cores they also depend on the schedule: a split backward runs more actions per
second, and each waits longer for its core (at tf = 0.5 ms on 2 cores, 4 workers: 0.02-0.1 ms more per forward than
with a whole backward); :class:`RuntimeRun` keeps each job's own figures.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chimera.schedule import Action, Costs, Kind, Schedule
from chimera.schedule.kinds import SPECS, Role

if TYPE_CHECKING:
    from chimera.job import Job
    from chimera.runtime.launch import LocalResult
    from chimera.timeline.events import Event

#: the compute kinds measured: those of a whole and a split backward
KINDS = ("F", "B", "I", "W")
#: the send kinds, which get the time of a send beyond ``p2p_busy`` (:func:`send_times`)
SENDS = tuple(k.value for k, spec in SPECS.items() if spec.role is Role.SEND)
#: the gradient sum's kinds, measured on a job with replicas (:func:`sync_times`)
SYNCS = (Kind.ALLREDUCE_START.value, Kind.ALLREDUCE_WAIT.value)
#: recorded steps of the replica job (after ``skip`` unrecorded ones): its sums are measured, not its steps
SYNC_STEPS = 4


@dataclass(frozen=True)
class RuntimeRun:
    """One calibration job (:func:`measure_runtime`): the lowered schedule it ran, whether its backward was split,
    the median seconds of its timed steps, and what the runtime itself took per action by kind: each compute kind
    beyond its sleeps, each send kind beyond ``p2p_s`` (the median of :func:`send_times`), each kind of a gradient
    sum as the replica job measured it (:func:`sync_times`; the same in both runs)."""

    schedule: Schedule
    split: bool
    step_s: float
    fixed: dict[str, float]


def measure_action_costs(workers: int = 2, steps: int = 12, skip: int = 4, micro_batches: int | None = None,
                         device: str = "cpu", sleep_s: float = 0.0) -> dict[str, float]:
    """Seconds per action of each compute kind (:data:`KINDS`) beyond its sleeps over the recorded steps
    (:func:`measure_runtime`) of 1F1B with a whole and with a split backward on ``workers`` workers, the delay
    model sleeping ``sleep_s`` per block (module docstring): per kind the mean of the jobs' medians."""
    fixed = pooled(measure_runtime(workers, steps, skip, micro_batches, device, sleep_s))
    return {k: v for k, v in fixed.items() if k in KINDS}


def measure_runtime(workers: int = 2, steps: int = 12, skip: int = 4, micro_batches: int | None = None,
                    device: str = "cpu", sleep_s: float = 0.0, launch: Callable[[Job], LocalResult] | None = None,
                    p2p_s: float = 0.0) -> list[RuntimeRun]:
    """Run 1F1B with a whole and with a split backward (the delay model sleeping ``sleep_s`` per block) and measure
    each (:class:`RuntimeRun`): steps ``skip`` to ``skip + max(1, (steps - skip) // 4) - 1`` record their actions
    (hundreds of them), one more is left out, the rest are timed, as they record nothing and follow a step that
    recorded nothing (a recording step runs slower, and consecutive steps overlap: the one after it starts late).
    With an even number of workers, Chimera first runs ``skip`` + :data:`SYNC_STEPS` steps, the last
    :data:`SYNC_STEPS` recorded, for the gradient sums' costs (:func:`sync_times`), which both runs' ``fixed``
    carry.
    ``launch`` runs each job and returns its records and events (default :func:`~chimera.runtime.run_local`):
    measure on the launcher whose steps are to be predicted. ``p2p_s``: what the simulator charges every send and
    receive already (the comm profile's ``p2p_busy``), and every gradient sum's start."""
    if workers < 2 or steps < skip + 3:
        raise ValueError(f"need workers >= 2 and steps >= skip + 3, got workers={workers}, steps={steps}, skip={skip}")
    recorded = tuple(range(skip, skip + max(1, (steps - skip) // 4)))
    if sleep_s < 0:
        raise ValueError(f"sleep_s is seconds per block, >= 0; got {sleep_s}")
    if launch is None:
        from chimera.runtime.launch import run_local as launch
    n = micro_batches or 2 * workers
    slept = sleeps(sleep_s, workers)
    syncs: dict[str, float] = {}
    if workers % 2 == 0:  # Chimera's replicas: every stage on two workers (2 micro-batches per worker: any N would do)
        job = _delay_job("chimera", False, workers, 2 * workers, skip + SYNC_STEPS, sleep_s, device,
                         tuple(range(skip, skip + SYNC_STEPS)))
        syncs = sync_times(launch(job).events, p2p_s)
    runs = []
    for split in (False, True):
        job = _delay_job("1f1b", split, workers, n, steps, sleep_s, device, recorded)
        result = launch(job)
        durations: dict[str, list[float]] = defaultdict(list)
        for e in result.events:
            if e.kind in KINDS:
                a = Action(Kind(e.kind), e.pipe, e.stage, e.microbatch, e.count)
                durations[e.kind].append(e.end - e.start - float(slept.of(a)))
        timed = [m["step_time_s"] for m in result.metrics[recorded[-1] + 2:]]
        fixed = {k: statistics.median(v) for k, v in durations.items()}
        sends = send_times(result.events, p2p_s)
        if sends:
            fixed.update(dict.fromkeys(SENDS, statistics.median(sends)))
        runs.append(RuntimeRun(job.schedule, split, statistics.median(timed), {**fixed, **syncs}))
    return runs


def _delay_job(schedule: str, split: bool, workers: int, micro_batches: int, steps: int, sleep_s: float, device: str,
               recorded: tuple[int, ...]) -> Job:
    """A calibration job: the delay model (one block per worker, sleeping ``sleep_s``) on ``schedule``, recording
    the steps ``recorded``."""
    from chimera.compile import compile_job
    from chimera.config import TrainConfig

    cfg = TrainConfig.from_flags(model="delay", model_overrides={"num_blocks": workers, "fwd_s": sleep_s},
                                 schedule=schedule, split_backward=split, stages=workers, micro_batches=micro_batches,
                                 micro_batch_size=2, steps=steps, optimizer="sgd", lr=1e-3, clip_grad=0.0, threads=1,
                                 device=device, corpus="synthetic", partition="uniform", profile=True,
                                 profile_steps=recorded)
    return compile_job(cfg)


def sync_times(events: Sequence[Event], p2p_s: float = 0.0) -> dict[str, float]:
    """The gradient sums' fixed seconds by kind (:data:`SYNCS`), medians over ``events``: a start's interval less
    ``p2p_s`` (its busy time in the simulation); a wait's from when the last other replica's start of the same
    stage and step ended plus ``p2p_s`` (its bucket's flight), or from its own start if later, to its end: what it
    takes once the sum can complete. {} where no sum was recorded."""
    starts: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in events:
        if e.kind == Kind.ALLREDUCE_START.value:
            starts[(e.iteration, e.stage)].append(e)
    begun, waited = [], []
    for e in events:
        if e.kind == Kind.ALLREDUCE_START.value:
            begun.append(max(0.0, e.end - e.start - p2p_s))
        elif e.kind == Kind.ALLREDUCE_WAIT.value:
            others = [s.end for s in starts[(e.iteration, e.stage)] if s.worker != e.worker]
            if others:
                waited.append(max(0.0, e.end - max(e.start, max(others) + p2p_s)))
    if not begun or not waited:
        return {}
    return dict(zip(SYNCS, (statistics.median(begun), statistics.median(waited))))


def send_times(events: Sequence[Event], p2p_s: float = 0.0) -> list[float]:
    """Per batch of sends alone (no receive: nothing in it waits for a peer), its interval per send, less
    ``p2p_s``: what a send costs its worker beyond the busy time the simulator charges every message. A batch is
    one interval: the runtime records its sends and receives with the batch's start and end."""
    batches: dict[tuple[int, int, float, float], list[str]] = defaultdict(list)
    for e in events:
        if Kind(e.kind).is_p2p:
            batches[(e.worker, e.iteration, e.start, e.end)].append(e.kind)
    return [max(0.0, (end - start) / len(kinds) - p2p_s) for (_, _, start, end), kinds in batches.items()
            if all(k in SENDS for k in kinds)]


def pooled(runs: Sequence[RuntimeRun]) -> dict[str, float]:
    """The runs' costs as one: per kind the mean of the runs' figures (B from the whole backward, I and W from the
    split one; :func:`mean_by_kind`)."""
    return mean_by_kind([r.fixed for r in runs])


def mean_by_kind(figures: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per kind, the mean of the figures that have it (a kind only some measured: the mean of those)."""
    kinds = dict.fromkeys(k for f in figures for k in f)
    return {k: statistics.fmean(f[k] for f in figures if k in f) for k in kinds}


def step_remainder(runs: Sequence[RuntimeRun], costs: Callable[[RuntimeRun], Costs]) -> float:
    """What a step costs beyond its actions: the median, over :func:`measure_runtime`'s ``runs``, of the run's step
    less the simulation of its schedule with ``costs(run)`` (the blocks' sleeps, the runtime's time per action and
    whatever else the caller prices: then not counted twice); 0 where the simulation is longer.
    Dispatching the step, its optimizer step, collecting its garbage and whatever else a step pays once: the
    planner charges it to the optimizer step."""
    from chimera.schedule import simulate

    extra = [r.step_s - float(simulate(r.schedule, costs(r)).makespan) for r in runs]
    return max(0.0, statistics.median(extra)) if extra else 0.0


def runtime_costs(workers: int, device: str = "cpu", p2p_s: float = 0.0) -> tuple[dict[str, float], float]:
    """The runtime's own time on ``workers`` local workers: per action by kind (:func:`measure_runtime`,
    :func:`pooled`), and per step beyond its actions (:func:`step_remainder`, every send and receive priced at
    ``p2p_s`` each way and of worker time, as the planner prices them with a profile's p2p link), as ``chimera
    profile --comm local`` records them (``Profile.actions``, ``Profile.step_s``)."""
    from dataclasses import replace

    runs = measure_runtime(workers, steps=16, skip=3, device=device, p2p_s=p2p_s)
    fixed = pooled(runs)

    def costs(r: RuntimeRun) -> Costs:
        return replace(sleeps(0.0, r.schedule.stages), fixed=tuple(fixed.items()), p2p_latency=p2p_s, p2p_busy=p2p_s)

    return fixed, step_remainder(runs, costs)


def sleeps(sleep_s: float, workers: int) -> Costs:
    """What the delay model sleeps per action when every block sleeps ``sleep_s`` (one block per stage): forward,
    input gradient and weight gradient each, except that the first stage's inputs need no gradient, so its weight
    gradient sleeps both (:meth:`Costs.first_stage_whole_backward`)."""
    return Costs(fwd=sleep_s, bwd=sleep_s, wgrad=sleep_s).first_stage_whole_backward(workers)

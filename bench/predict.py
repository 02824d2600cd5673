"""Simulator predictions for the rows of ``bench/vs_torch_pipelining.py``.

Delay model: the period of ``run`` consecutive steps after a first one (``chimera.schedule.steps.period``: the
mean step after the first, every worker starting its next step as soon as its list allows; the benchmark's jobs
do not clip, so no global norm holds the steps apart) with ``delay_costs(tf, D)``: F = tf, input gradient tf, weight gradient tf
(a whole backward 2·tf), except that the first stage's input gradient is nothing and its weight gradient both
(its inputs need no gradient); tf/2 per stage for a schedule over the 2·D-stage split. Chimera rows simulate
the schedule the job runs (``auto``: the one it chose); torch.pp's GPipe and 1F1B rows chimera's generator of the
same order; torch.pp's multi-stage rows (Interleaved1F1B, DualPipeV, ZBVZeroBubble, InterleavedZeroBubble,
LoopedBFS) the compute order torch's schedule object itself runs (its ``pipeline_order``, sent by rank 0;
``bench.torchpp_runner.compute_order``).

Chimera rows are predicted with the runtime's own costs too (:class:`Calibration`, measured per workload once its
rows' processes are up, so that their idle load is in it, right before and right after the rows' steps, and
averaged: :meth:`Calibration.mean`): the lowered schedule the job runs, every message the
one-way time of a ping-pong between two processes of this machine over the runtime's p2p (shared memory), and as
much of the worker's time to post and complete it, every send the runtime's time per send beyond that, every
gradient sum one such exchange and the runtime's time per start and wait of a sum beyond it (a short Chimera job
of the calibration, :func:`chimera.calibrate.sync_times`), every compute action the runtime's fixed time per action of its kind
(:func:`chimera.calibrate.measure_runtime`, its blocks sleeping like the rows' actions, up to 10 ms: beyond its
sleeps), and every step what those 1F1B steps take beyond their simulation with those costs, charged to the
optimizer step. Where the rows' workers outnumber the machine's cores (four on the 2-core development machine,
pinned two to a core), the runtime's own time per action holds its worker's core, in turn with the other worker
pinned there (``Costs.cores``, :mod:`chimera.schedule.cores`); the sleeps do not. The calibration runs 1F1B twice,
with a whole and with a split backward, on the rows' launcher; each row is priced with the run of its own
backward's form (:class:`Calibration`). torch.pp rows keep the
schedule-only figure: their runtime's costs are torch's, not measured here.

No prediction (None) for the real-model rows: one-thread stage profiles taken on the shared 2-core development
machine varied by up to 2x between runs, so a prediction from them would say more about the machine's load
than about the schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from bench.workloads import Workload
from chimera.calibrate import mean_by_kind, sleeps
from chimera.job import Job
from chimera.plan.costs import per_step
from chimera.runtime.launch import LocalResult
from chimera.schedule import Costs, Schedule, build_schedule, simulate
from chimera.schedule.steps import period
from chimera.util.cores import shared_cores

#: the longest sleep the calibration runs with: the cost of waking from a sleep levels off by ~10 ms (0.54-0.67 ms
#: per action at 10 ms, 0.62-0.70 at 25 ms, 0.15-0.19 never sleeping), and longer sleeps only lengthen it
SLEEP_CAP_S = 0.01
#: steps of each calibration run (1F1B whole and split): a quarter after the warm-up record their actions, the rest
#: are timed for the per-step remainder. A step varies by ±2 ms from one to the next at D = 4, N = 8: at tf = 0.5 ms
#: the whole backward's remainder read 0.62, 3.39, 1.30 ms in three runs of 24 steps (half recorded, 9 timed), 0.17,
#: 0.28, 0.79 ms in three of 32 (7 recorded, 20 timed)
CALIBRATION_STEPS = 32


def delay_costs(tf: float, stages: int) -> Costs:
    """The delay model's simulator costs per stage (module docstring): what it sleeps per action
    (:func:`chimera.calibrate.sleeps`)."""
    return sleeps(tf, stages)


@dataclass(frozen=True)
class RuntimeCosts:
    """The runtime's own costs as one calibration job measured them (:class:`chimera.calibrate.RuntimeRun`): fixed
    seconds per action by kind (compute kinds beyond their sleeps, sends beyond the p2p's one-way time), and what a
    step costs beyond its actions (charged to its optimizer step)."""

    fixed: tuple[tuple[str, float], ...]
    step_s: float = 0.0

    def text(self) -> str:
        per = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in self.fixed)
        return f"per action {per}; per step beyond them {self.step_s * 1e3:.3f}"


@dataclass(frozen=True)
class Calibration:
    """The runtime's costs on this machine: the one-way time of a small message between two processes on the
    runtime's p2p (the link's limit), and the runtime's own costs as the whole-backward and the split-backward
    calibration jobs measured them. A row is priced with the job of its own backward: where workers share cores,
    a split backward's many short actions wait longer for theirs (:mod:`chimera.calibrate`)."""

    p2p_s: float
    whole: RuntimeCosts
    split: RuntimeCosts
    cores: tuple[int, ...] = ()

    @staticmethod
    def measure(workers: int, tf: float = 0.0, steps: int = CALIBRATION_STEPS,
                launch: Callable[[Job], LocalResult] | None = None) -> Calibration:
        """Measured with the delay model sleeping like the rows' actions (``tf`` per block, at most
        :data:`SLEEP_CAP_S`): a worker that sleeps pays more per action than one that never does
        (:mod:`chimera.calibrate`); ``steps`` per calibration run (:data:`CALIBRATION_STEPS`), each run by ``launch``
        (the rows' launcher; default: local processes)."""
        from chimera.calibrate import measure_runtime, step_remainder
        from chimera.profile.comm import measure_comm_local

        sleep = min(tf, SLEEP_CAP_S)
        p2p = measure_comm_local(2, sizes=(512,), reps=200).p2p.latency_s
        cores = shared_cores(workers)
        forms = {}
        for run in measure_runtime(workers, steps=steps, sleep_s=sleep, launch=launch, p2p_s=p2p):
            own = RuntimeCosts(tuple(run.fixed.items()))
            # the run's steps beyond their simulation with its own costs: its per-step remainder
            step = step_remainder([run], lambda r, own=own: _priced(delay_costs(sleep, r.schedule.stages), p2p, own,
                                                                    cores))
            forms[run.split] = replace(own, step_s=step)
        return Calibration(p2p, forms[False], forms[True], cores)

    def mean(self, other: Calibration) -> Calibration:
        """The mean of two calibrations of one workload, figure by figure: the benchmark measures one right before
        its rows' steps and one right after them, so that the pair brackets the rows' window. A calibration run's
        figures move from one job to the next by more than its steps' spread (at tf = 0.5 ms the per-step remainder
        read 2.1-3.4 ms in runs of 32 steps and 2.5-3.4 ms in runs of 128), and the machine drifts while the rows
        run. Over 17 runs in a noisy hour (51 row predictions at tf = 0, 0.5 and 2 ms), the mean absolute error was
        3.9 % with the calibration before the rows, 3.3 % with the mean of the pair (the largest 16.9 against
        13.1 %; within 3 %: 29 against 30 of 51; ``bench/RESULTS.md``, eighteenth round): a small gain, for
        one more calibration (~20 s) per workload."""
        if self.cores != other.cores:
            raise ValueError(f"calibrations on different cores ({self.cores} and {other.cores}) do not average")
        return Calibration((self.p2p_s + other.p2p_s) / 2, _mean(self.whole, other.whole),
                           _mean(self.split, other.split), self.cores)

    def costs(self, tf: float, schedule: Schedule) -> Costs:
        """The delay costs of ``schedule`` with the runtime costs of its backward's form (class docstring); the
        step's remainder on its optimizer step, or spread over each worker's post-validated stage updates
        (``chimera.plan.costs.per_step``)."""
        form = self.split if schedule.splits_backward else self.whole
        return per_step(_priced(delay_costs(tf, schedule.stages), self.p2p_s, form, self.cores), form.step_s,
                        schedule)

    def text(self) -> str:
        return (f"ping-pong one way on the runtime's p2p (shared memory; the link's limit) {self.p2p_s * 1e3:.3f} ms; "
                f"runtime, whole backward (ms): {self.whole.text()}; split backward: {self.split.text()}"
                + (f"; workers on cores {', '.join(map(str, self.cores))}" if self.cores else ""))


def _mean(a: RuntimeCosts, b: RuntimeCosts) -> RuntimeCosts:
    """Per kind the mean of the two runs' fixed seconds (:func:`chimera.calibrate.mean_by_kind`: a kind only one of
    them measured keeps its figure), and the mean of their per-step remainders."""
    return RuntimeCosts(tuple(mean_by_kind([dict(a.fixed), dict(b.fixed)]).items()), (a.step_s + b.step_s) / 2)


def _priced(costs: Costs, p2p_s: float, own: RuntimeCosts, cores: tuple[int, ...] = ()) -> Costs:
    """``costs`` with every message ``p2p_s`` one way and as much of its worker's time, every gradient sum one such
    exchange, the runtime's own costs ``own`` per action (not yet per step), and the workers' ``cores`` where they
    share them (the delay model's compute sleeps: only the runtime's own time holds a core)."""
    return replace(costs, fixed=own.fixed, p2p_latency=p2p_s, p2p_busy=p2p_s, allreduce=p2p_s, sync_start=p2p_s,
                   cores=cores, cpu_compute=False)


def predicted_step_s(w: Workload, system: str, schedule: str, sched: Schedule | None = None,
                     calibration: Calibration | None = None, run: int = 1) -> float | None:
    """The simulator's figure for the row (``sched``: the schedule the row runs; without it, chimera's generator of
    ``schedule``), or None: one step's makespan (``run`` 1), else the period of ``run`` steps after a first one. With
    ``calibration`` (chimera rows): the lowered ``sched`` with the runtime's costs."""
    if not w.is_delay or (sched is None and system == "torch.pp" and schedule not in ("gpipe", "1f1b")):
        return None
    assert w.tf is not None
    if sched is None:
        sched = build_schedule(schedule, w.stages, w.micro_batches)
    tf = w.tf * w.stages / sched.stages  # a schedule of 2·D stages runs D ranks' work in halves
    if calibration is not None and sched.lowered:
        costs = calibration.costs(tf, sched)
    else:
        sched, costs = sched.compute_only(), delay_costs(tf, sched.stages)
    if run == 1:
        return float(simulate(sched, costs).makespan)
    return float(period(sched, costs, steps=run + 1, overlap=True).period)

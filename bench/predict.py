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
rows' processes are up, so that their idle load is in it): the lowered schedule the job runs, every message the
one-way time of a ping-pong between two processes of this machine over the runtime's p2p (shared memory), and as
much of the worker's time to post and complete it, every gradient sum one such exchange, every compute action the runtime's fixed time per action of its
kind (:func:`chimera.calibrate.measure_action_costs`, its blocks sleeping like the rows' actions, up to 10 ms:
beyond its sleeps), and every step what those 1F1B steps (run locally, whole and split backward) take beyond
their simulation with those costs, charged to the optimizer step. torch.pp rows keep the schedule-only figure:
their runtime's costs are torch's, not measured here.

No prediction (None) for the real-model rows: one-thread stage profiles taken on the shared 2-core development
machine varied by up to 2x between runs, so a prediction from them would say more about the machine's load
than about the schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from bench.workloads import Workload
from chimera.calibrate import sleeps
from chimera.job import Job
from chimera.plan.costs import per_step
from chimera.runtime.launch import LocalResult
from chimera.schedule import Costs, Schedule, build_schedule, simulate
from chimera.schedule.steps import period

#: the longest sleep the calibration runs with: the cost of waking from a sleep levels off by ~10 ms (0.54-0.67 ms
#: per action at 10 ms, 0.62-0.70 at 25 ms, 0.15-0.19 never sleeping), and longer sleeps only lengthen it
SLEEP_CAP_S = 0.01
#: steps of each calibration run (1F1B whole and split): the first half after the warm-up record their actions, the
#: rest are timed for the per-step remainder. At tf = 2 ms, D = 4, N = 8 a step varies by ±2 ms from one to the next:
#: 12 steps (3 timed) gave remainders 2.4-6.3 ms from run to run, 24 (9 timed) 5.4-5.6 ms
CALIBRATION_STEPS = 24


def delay_costs(tf: float, stages: int) -> Costs:
    """The delay model's simulator costs per stage (module docstring): what it sleeps per action
    (:func:`chimera.calibrate.sleeps`)."""
    return sleeps(tf, stages)


@dataclass(frozen=True)
class Calibration:
    """The runtime's costs on this machine: the one-way time of a small gloo message between two processes (the
    link's limit) and the fixed seconds per compute action by kind."""

    p2p_s: float
    fixed: tuple[tuple[str, float], ...]
    step_s: float = 0.0  # what a step costs beyond its actions (charged to its optimizer step)

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
        fixed, runs = measure_runtime(workers, steps=steps, sleep_s=sleep, launch=launch)
        c = Calibration(p2p, tuple(fixed.items()))
        # the calibration runs' steps beyond their simulation with these costs: the per-step remainder
        return replace(c, step_s=step_remainder(runs, lambda s: c.costs(sleep, s)))

    def costs(self, tf: float, schedule: Schedule) -> Costs:
        """The delay costs of ``schedule`` with these runtime costs (module docstring); the step's remainder on its
        optimizer step, or spread over each worker's post-validated stage updates (``chimera.plan.costs.per_step``)."""
        c = replace(delay_costs(tf, schedule.stages), fixed=self.fixed, p2p_latency=self.p2p_s, p2p_busy=self.p2p_s,
                    allreduce=self.p2p_s, sync_start=self.p2p_s)
        return per_step(c, self.step_s, schedule)

    def text(self) -> str:
        per = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in self.fixed)
        return (f"ping-pong one way on the runtime's p2p (shared memory; the link's limit) {self.p2p_s * 1e3:.3f} ms; "
                f"runtime per action (ms): {per}; per step beyond its actions {self.step_s * 1e3:.3f} ms")


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

"""Simulator predictions for the rows of ``bench/vs_torch_pipelining.py``.

Delay model: ``simulate(schedule, delay_costs(tf, D)).makespan``: F = tf, input gradient tf, weight gradient tf
(a whole backward 2·tf), except that the first stage's input gradient is nothing and its weight gradient both
(its inputs need no gradient); tf/2 per stage for a schedule over the 2·D-stage split. Chimera rows simulate
the schedule the job runs (``auto``: the one it chose); torch.pp's GPipe and 1F1B rows chimera's generator of the
same order; torch.pp's multi-stage rows (Interleaved1F1B, DualPipeV, ZBVZeroBubble, InterleavedZeroBubble,
LoopedBFS) the compute order torch's schedule object itself runs (its ``pipeline_order``, sent by rank 0;
``bench.torchpp_runner.compute_order``). No communication or optimizer cost is modelled.

No prediction (None) for the real-model rows: one-thread stage profiles taken on the shared 2-core development
machine varied by up to 2x between runs, so a prediction from them would say more about the machine's load
than about the schedule.
"""

from __future__ import annotations

from bench.workloads import Workload
from chimera.schedule import Costs, Schedule, build_schedule, simulate


def delay_costs(tf: float, stages: int) -> Costs:
    """The delay model's simulator costs per stage (module docstring)."""
    return Costs(fwd=tf, bwd=tf, wgrad=tf).first_stage_whole_backward(stages)


def predicted_step_s(w: Workload, system: str, schedule: str, sched: Schedule | None = None) -> float | None:
    """The simulator's makespan for the row (``sched``: the schedule the row runs; without it, chimera's generator
    of ``schedule``), or None."""
    if not w.is_delay or (sched is None and system == "torch.pp" and schedule not in ("gpipe", "1f1b")):
        return None
    assert w.tf is not None
    if sched is None:
        sched = build_schedule(schedule, w.stages, w.micro_batches)
    tf = w.tf * w.stages / sched.stages  # a schedule of 2·D stages runs D ranks' work in halves
    return float(simulate(sched.compute_only(), delay_costs(tf, sched.stages)).makespan)

"""Simulator predictions for the rows of ``bench/vs_torch_pipelining.py``.

Delay model: ``simulate(build_schedule(name, D, N), Costs(fwd=tf, bwd=2·tf)).makespan`` (tf/2 and tf per
stage for torch's Interleaved1F1B over the 2·D-stage split, scheduled by chimera's interleaved generator,
which follows torch's order). No communication or optimizer cost is modelled.

No prediction (None) for DualPipeV (no chimera generator) and for the real-model rows: one-thread stage
profiles taken on the shared 2-core development machine varied by up to 2x between runs, so a prediction
from them would say more about the machine's load than about the schedule.
"""

from __future__ import annotations

from bench.workloads import Workload
from chimera.schedule import Costs, build_schedule, simulate


def predicted_step_s(w: Workload, system: str, schedule: str) -> float | None:
    """The simulator's makespan for the row, or None (DualPipeV, real models)."""
    if schedule == "dualpipev" or not w.is_delay:
        return None
    assert w.tf is not None
    interleaved = system == "torch.pp" and schedule == "interleaved1f1b"
    tf = w.tf / 2 if interleaved else w.tf
    sched = build_schedule("interleaved" if interleaved else schedule, w.stages, w.micro_batches, chunks=2)
    return float(simulate(sched, Costs(fwd=tf, bwd=2 * tf)).makespan)

#!/usr/bin/env python
"""Post-validated steps against drained ones on the delay model: the same schedule and clipping, side by side.

Each schedule runs three ways in one process per worker (``chimera.runtime.local_steps``, no Ray), with the delay
model's sleeps as compute:

* ``drained``: ``--clip-grad 1.0``: the global norm's allreduce ends every step on every worker;
* ``post-validated``: ``--clip-grad 1.0 --post-validate``: each stage updated as soon as its gradients are
  complete, the norm checked during the next step (``chimera.runtime.post_validate``);
* ``post-validated, clipping every step``: ``--clip-grad 1e-9 --post-validate``: every step rolled back and redone
  (the worst case: one repeated step, then drained steps until one is kept);
* ``no checks``: ``--clip-grad 0``: nothing global at a step's end (the floor post-validation aims at).

A row's time is the steady state's period as the simulator defines it: ``(E_k - E_1) / (k - 1)``, ``E_j`` the
latest end of step j on any worker (``StepResult.ended_s``, one clock for the processes of this host); the first
step starts from an empty pipeline. The simulated figures are the period of the job's own lowered schedule over
the same number of steps with the delay model's costs (drained: its steps in sequence), without the runtime's own
costs (messages, optimizer), so the measured rows run a few per cent over them. The *predicted* figures add the
runtime's costs measured on this machine once per run, as ``bench/vs_torch_pipelining.py`` predicts its rows
(``bench.predict.Calibration``: the p2p's one-way time per message and gradient sum, the fixed time per compute
action and per send, and what a step costs beyond its actions, charged to the drained step's optimizer step or,
post-validated, spread over the worker's stage updates; each row with the calibration job of its backward's form); ``--no-calibrate`` leaves them out. The rows that clip every step are
not predicted: the simulator does not repeat a step.
The ``updates`` column counts what the verdicts decided (the delay model's gradients stay under a clip of 1.0).

    python bench/post_validate.py --schedules zb-v,zb-h2,1f1b --steps 6
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chimera_runner import chimera_config  # noqa: E402
from bench.predict import Calibration  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402
from chimera.compile import compile_job  # noqa: E402
from chimera.compile.schedule import auto_costs  # noqa: E402
from chimera.plan.period import tied_stages  # noqa: E402
from chimera.runtime.launch import local_steps  # noqa: E402
from chimera.schedule.steps import period  # noqa: E402

VARIANTS = {"drained": {"clip_grad": 1.0}, "post-validated": {"clip_grad": 1.0, "post_validate": True},
            "post-validated, clipping every step": {"clip_grad": 1e-9, "post_validate": True},
            "no checks": {"clip_grad": 0.0}}
REPEATING = {"post-validated, clipping every step"}  # not predicted: no simulation repeats a step


def measure(workload: str, schedule: str, variant: str, steps: int, tied: bool = False,
            calibration: Calibration | None = None) -> tuple[float, float, float | None, list[str]]:
    """(measured period s, simulated period s, predicted period s with ``calibration`` or None, post-validation
    outcomes) of one row."""
    w = WORKLOADS[workload]
    cfg = chimera_config(w, schedule, steps)
    cfg = cfg.with_flags(**VARIANTS[variant], model_overrides={**cfg.model.overrides, "tied": tied})
    job = compile_job(cfg)
    ends: dict[int, float] = {}
    outcomes = []
    for kind, payload in local_steps(job):
        if kind == "step":
            record, results = payload
            outcomes.append(record.get("update", ""))
            ends[record["step"]] = max(r.ended_s for r in results)
    measured = (ends[steps - 1] - ends[0]) / (steps - 1)
    costs, _ = auto_costs(job.chain, job.schedule.stages, w.micro_batch_size)
    pairs = [(a, b) for (a, _), (b, _) in job.chain.tied_parameters()]
    tied_groups = tied_stages(pairs, job.stage_layers)
    overlap = variant != "drained"
    simulated = float(period(job.schedule, costs, steps, overlap=overlap, tied=tied_groups).period)
    predicted = None
    if calibration is not None and variant not in REPEATING:
        costs = calibration.costs(w.tf * w.stages / job.schedule.stages, job.schedule)
        predicted = float(period(job.schedule, costs, steps, overlap=overlap, tied=tied_groups).period)
    return measured, simulated, predicted, outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="delay-d4-n8", choices=sorted(k for k in WORKLOADS if k.startswith("delay")))
    ap.add_argument("--schedules", default="zb-v,zb-h2,1f1b")
    ap.add_argument("--steps", type=int, default=6, help="steps per row (the first is not timed)")
    ap.add_argument("--tied", action="store_true", help="tie the delay model's embedding and head weights (the sum "
                    "of their gradients holds the first and the last stage's workers at each step)")
    ap.add_argument("--no-calibrate", action="store_true", help="no predictions with the runtime's costs (saves "
                    "the calibration's ~20 s)")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    calibration = None if args.no_calibrate else Calibration.measure(w.stages, float(w.tf or 0.0))
    print(f"{args.workload}{' (tied embedding and head)' if args.tied else ''}, {args.steps} steps per row, steps "
          "after the first timed")
    if calibration is not None:
        print(f"calibration: {calibration.text()}")
    print("\n| schedule | variant | measured s / step | simulated period s | measured / simulated - 1 | "
          "predicted period s | measured / predicted - 1 | / drained (measured) | updates |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.schedules.split(","):
        base = None
        for variant in VARIANTS:
            m, s, p, outcomes = measure(args.workload, name, variant, args.steps, args.tied, calibration)
            base = base or m
            seen = ", ".join(f"{o} {outcomes.count(o)}" for o in sorted(set(outcomes)) if o) or "—"
            pred = f"{p:.3f} | {m / p - 1:+.3f}" if p is not None else "— | —"
            print(f"| {name} | {variant} | {m:.3f} | {s:.3f} | {m / s - 1:+.3f} | {pred} | {m / base:.3f} | {seen} |",
                  flush=True)


if __name__ == "__main__":
    main()

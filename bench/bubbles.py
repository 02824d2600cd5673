"""Measured bubble fraction of the real runtime on Ray against the simulator, on the delay model.

The delay model's forward sleeps tf and its backward 2*tf per stage and per schedule unit (tf in its
input-gradient part, tf in its weight-gradient part), so D workers do not fight over the machine's cores. Each row runs the schedule through ray_launch (profiling on), takes the
runtime's own action timestamps, and compares the median measured bubble with the simulator's prediction for
the same lowered schedule with F = tf, B = 2 tf per unit. Chimera's forward doubling runs with --recompute, as
the paper pairs them: there every backward but the last stage's also sleeps its forward again (B = 3 tf). The
delay model sleeps per unit whatever its size, so backward halving's half micro-batches cost tf and 2 tf as
well. Split-backward rows (ZB-H1, ZB-H2, Chimera and 1F1B with --split-backward) predict with I = W = tf, except
on the first stage, whose inputs need no gradient: there I does nothing and W the whole backward (as in
torch.distributed.pipelining). BitPipe runs 2D stages of one block each, sleeping tf/2 (the same work per
worker). Measured two ways: over the whole step (first event to last, the gradient sums and the optimizer step
included) and over the compute window (first compute action to last), the span the simulator's compute-only
schedule predicts. Goal: |measured - predicted| <= 0.03 over the compute window; the whole-step figure is shown
beside it.

Usage: python bench/bubbles.py [--tf 0.05] [--steps 6] [--quick] [--rows chimera-halving] [--rows split]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from bench.predict import delay_costs  # noqa: E402
from chimera.compile import compile_job  # noqa: E402
from chimera.config import TrainConfig  # noqa: E402
from chimera.schedule import Costs, simulate  # noqa: E402
from chimera.schedule.registry import get as schedule_spec  # noqa: E402
from chimera.timeline.analysis import step_stats  # noqa: E402
from ray_launch.driver import RayJob  # noqa: E402

ROWS = [("chimera", 4, 4, "direct"), ("1f1b", 4, 4, "direct"), ("gpipe", 4, 4, "direct"),
        ("chimera", 4, 8, "direct"), ("1f1b", 4, 8, "direct"), ("gpipe", 4, 8, "direct"),
        ("chimera", 8, 8, "direct"), ("1f1b", 8, 8, "direct"), ("gpipe", 8, 8, "direct"),
        ("chimera", 4, 8, "doubling"), ("chimera", 4, 8, "halving"),
        ("chimera", 4, 16, "direct"), ("chimera", 4, 16, "doubling"), ("chimera", 4, 16, "halving"),
        ("1f1b", 4, 16, "direct"),
        # split backward (I + W)
        ("zb-h1", 4, 8, "direct"), ("zb-h2", 4, 8, "direct"), ("1f1b", 4, 8, "split"), ("chimera", 4, 4, "split"),
        ("chimera", 4, 8, "split"), ("chimera", 8, 16, "split"), ("zb-h1", 8, 16, "direct"), ("bitpipe", 4, 8, "direct"),
        ("chimera4", 4, 4, "direct"), ("chimera4", 4, 8, "direct"), ("chimera4", 8, 16, "direct")]

HALF_STAGES = ("bitpipe",)  # 2D stages of half a block's sleep each


def measure(schedule: str, d: int, n: int, mode: str, tf: float, steps: int) -> dict[str, float]:
    recompute = mode == "doubling"
    split = mode == "split" or schedule_spec(schedule).split_only
    parts = 2 * d if schedule in HALF_STAGES else d
    tf = tf * d / parts
    cfg = TrainConfig.from_flags(model="delay", model_overrides={"num_blocks": parts, "fwd_s": tf}, schedule=schedule,
                                 stages=d, micro_batches=n, micro_batch_size=2, steps=steps, optimizer="sgd",
                                 profile=True, clip_grad=0.0, timeout_s=60, mode="direct" if split else mode,
                                 recompute=recompute, split_backward=split, partition="uniform")
    with RayJob(compile_job(cfg)) as ray_job:
        records = [ray_job.step(s) for s in range(steps)]
        sched = ray_job.job.schedule
    events = [e for rec in records[1:] for r in rec["_results"] for e in r.events]  # step 0 is warm-up
    stats = step_stats(events)
    window = step_stats(events, compute_only=True)
    unit = 1 / sched.microbatch_scale  # costs are per micro-batch; every unit sleeps the same
    if split:  # I = W = tf; the first stage's I has no input gradient to make, its W does both halves
        costs = delay_costs(tf * unit, parts)
    else:
        costs = Costs(fwd=tf * unit, bwd=[(3 if recompute and s < d - 1 else 2) * tf * unit for s in range(d)])
    pred = simulate(sched.compute_only(), costs)
    return {
        "measured_bubble": statistics.median(s.bubble for s in stats),
        "compute_bubble": statistics.median(s.bubble for s in window),
        "predicted_bubble": float(pred.bubble),
        "measured_step_s": statistics.median(s.makespan for s in stats),
        "predicted_step_s": float(pred.makespan),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tf", type=float, default=0.05, help="forward sleep per stage (s)")
    ap.add_argument("--steps", type=int, default=6, help="steps per row (the first is warm-up)")
    ap.add_argument("--quick", action="store_true", help="only the D=4, N=4 rows, 2 steps")
    ap.add_argument("--rows", default=None, help="only rows whose 'schedule-mode' contains this, e.g. chimera-halving")
    args = ap.parse_args()
    rows = ROWS[:3] if args.quick else ROWS
    if args.rows:
        rows = [r for r in rows if args.rows in f"{r[0]}-{r[3]}"]
    steps = 2 if args.quick else args.steps
    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        print(f"# bubbles: delay model tf={args.tf}s, bwd=2tf (split: I = W = tf), {steps - 1} measured steps per row")
        print("| schedule | mode | D | N | measured bubble, whole step | measured bubble, compute window | predicted "
              "bubble | diff (whole step) | diff (compute window) | measured step s | predicted step s | goal |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for schedule, d, n, mode in rows:
            r = measure(schedule, d, n, mode, args.tf, steps)
            diff = r["measured_bubble"] - r["predicted_bubble"]
            like = r["compute_bubble"] - r["predicted_bubble"]  # the window the simulator predicts
            ok = "ok" if abs(like) <= 0.03 else "MISSED"
            print(f"| {schedule} | {mode}{' + recompute' if mode == 'doubling' else ''} | {d} | {n} | "
                  f"{r['measured_bubble']:.3f} | {r['compute_bubble']:.3f} | {r['predicted_bubble']:.3f} | "
                  f"{diff:+.3f} | {like:+.3f} | {r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | {ok} |",
                  flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

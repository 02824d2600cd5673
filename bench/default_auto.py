"""The default job under ``--schedule auto`` against plain Chimera, side by side: does ``auto``'s choice, ranked with
the model's own profile, run no slower than Chimera?

Both rows are the default job (BERT-mini, D = 4, N = 4, B = 4, sequence 64, the shipped sample corpus, the
partition planned from the model's profile), compiled as ``chimera train`` compiles them; each repetition starts a
fresh job of each row in turn (alternating, so both see the same machine) and times steps 1.. of ``--steps`` (the
worker-side step time, its median). The table gives each row's choice, its prediction and its measured step.

Usage: python bench/default_auto.py [--steps 8] [--reps 3] [--results bench/RESULTS.md|-]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_launch import keep_local_ray_on_loopback  # noqa: E402

keep_local_ray_on_loopback([])
from chimera.compile import compile_job  # noqa: E402
from chimera.config import TrainConfig  # noqa: E402
from ray_launch.driver import RayJob  # noqa: E402


def measure(schedule: str, steps: int) -> tuple[str, float | None, float]:
    """(what ran, its prediction, the median worker-side step time of steps 1..)."""
    job = compile_job(TrainConfig.from_flags(schedule=schedule, steps=steps))
    label = next((d.split(": ")[1] for d in job.decisions if d.startswith("auto: ")), schedule)
    with RayJob(job, log=lambda msg: None) as rj:
        records = list(rj.steps(range(steps)))
    return label, job.prediction.step_s if job.prediction else None, statistics.median(
        r["step_time_s"] for r in records[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--results", default=str(Path(__file__).with_name("RESULTS.md")))
    args = ap.parse_args()
    rows: dict[str, list[tuple[str, float | None, float]]] = {"chimera": [], "auto": []}
    for rep in range(args.reps):
        for schedule in rows:
            rows[schedule].append(measure(schedule, args.steps))
            print(f"rep {rep} {schedule}: {rows[schedule][-1]}", flush=True)
    base = statistics.median(m for _, _, m in rows["chimera"])
    lines = [f"`python bench/default_auto.py --steps {args.steps} --reps {args.reps}` "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             "| row | ran | predicted s | measured s (median of reps) | measured / Chimera's |", "|---|---|---|---|---|"]
    for schedule, runs in rows.items():
        measured = statistics.median(m for _, _, m in runs)
        predicted = [p for _, p, _ in runs if p is not None]
        pred = f"{statistics.median(predicted):.4f}" if predicted else "-"
        lines.append(f"| {schedule} | {runs[-1][0]} | {pred} | {measured:.4f} | {measured / base:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results != "-":
        with open(args.results, "a") as f:
            f.write("\n### The default job: --schedule auto against Chimera\n\n" + text)


if __name__ == "__main__":
    main()

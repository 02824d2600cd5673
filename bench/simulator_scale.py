"""Time to generate, lower, validate and simulate large schedules (goal: under 5 s each), what a planner pays
per extra simulation of a prepared schedule, and the CLI's wall time.

Usage: python bench/simulator_scale.py [--stages 64] [--micro-batches 512] [--no-cli]

``simulate s`` is the first simulation of the lowered schedule (it prepares the schedule: one replay without
times); ``again s`` a second one with other costs (float), which only times the prepared schedule. The second
table does the same for the compute-only schedule with float costs, and the third times
``python -m chimera.cli schedule simulate chimera -D .. -N ..`` (Python start-up included; median of 3).
The last table times the planner (``chimera.plan.plan``) on a profile made of numbers: a 66-layer model on
2048 workers, with D fixed at 64 (W = 32) and over every D; and BERT-48 (paper-like numbers) on 32 workers.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from chimera.schedule import Costs, build_schedule, lower, simulate, validate


def timed(f: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t0


def measure(name: str, d: int, n: int) -> dict[str, float]:
    t: dict[str, float] = {}
    s, t["generate"] = timed(lambda: build_schedule(name, d, n))
    low, t["lower"] = timed(lambda: lower(s))
    _, t["validate"] = timed(lambda: validate(low))
    r, t["simulate"] = timed(lambda: simulate(low, Costs(fwd=1, bwd=2)))
    t["total"] = sum(t.values())
    _, t["again"] = timed(lambda: simulate(low, Costs(fwd=1.5, bwd=2.5, p2p_latency=0.1)))
    t["actions"] = sum(len(row) for row in low.actions)
    t["makespan"] = float(r.makespan)
    return t


def compute_only(name: str, d: int, n: int) -> tuple[float, float]:
    """Seconds of the first (preparing) and of a later simulation of the compute-only schedule, float costs."""
    s = build_schedule(name, d, n)
    _, first = timed(lambda: simulate(s, Costs(fwd=1.0, bwd=2.0)))
    costs = [Costs(fwd=1.0 + k / 10, bwd=2.0) for k in range(3)]
    again = min(timed(lambda c=c: simulate(s, c))[1] for c in costs)
    return first, again


def cli_wall(d: int, n: int) -> float:
    cmd = [sys.executable, "-m", "chimera.cli", "schedule", "simulate", "chimera", "-D", str(d), "-N", str(n)]
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=512)
    ap.add_argument("--no-cli", action="store_true", help="skip the CLI wall time")
    args = ap.parse_args()
    d, n = args.stages, args.micro_batches
    print(f"# simulator scale, D={d}, N={n}, {platform.processor() or platform.machine()}")
    print("| schedule | actions (lowered) | generate s | lower s | validate s | simulate s | total s | goal | again s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("chimera", "1f1b"):
        t = measure(name, d, n)
        ok = "ok (< 5 s)" if t["total"] < 5 else "MISSED (>= 5 s)"
        print(f"| {name} | {int(t['actions'])} | {t['generate']:.3f} | {t['lower']:.3f} | {t['validate']:.3f} | "
              f"{t['simulate']:.3f} | {t['total']:.3f} | {ok} | {t['again']:.3f} |")
    print("\n| compute-only, float costs | first simulate s (prepares) | simulate again s |")
    print("|---|---|---|")
    for name in ("chimera", "1f1b"):
        first, again = compute_only(name, d, n)
        print(f"| {name} | {first:.3f} | {again:.3f} |")
    if not args.no_cli:
        print(f"\nCLI `chimera schedule simulate chimera -D {d} -N {n}`: {cli_wall(d, n):.2f} s wall (median of 3)")
    planner()


def planner() -> None:
    from chimera.plan import plan
    from chimera.profile.synthetic import bert48_paper_like, layer, profile

    sizes = (1, 2, 4, 8)
    big = profile([layer(i, 0.002, 4 * 20_000_000, 10_000_000, 1_000_000, sizes) for i in range(66)], sizes)
    print("\n| planner | candidates ranked / infeasible | seconds | goal |\n|---|---|---|---|")
    for label, args in (("66 layers, 2048 workers, D = 64 (W = 32)", (big, 2048, 2048 * 8, 80 * 2**30, 64)),
                        ("66 layers, 2048 workers, every D", (big, 2048, 2048 * 8, 80 * 2**30, None)),
                        ("BERT-48 paper-like, 32 workers, every D", (bert48_paper_like(), 32, 256, 16 * 2**30, None))):
        prof, workers, g, limit, d = args
        r, t = timed(lambda: plan(prof, workers, g, limit, "adamw", 10, stages=d))  # noqa: B023
        print(f"| {label} | {len(r.ranked)} / {len(r.infeasible)} | {t:.2f} | {'ok' if t < 10 else 'MISSED'} "
              "(< 10 s) |")


if __name__ == "__main__":
    main()

"""Time to generate, lower, validate and simulate large schedules (goal: under 5 s each).

Usage: python bench/simulator_scale.py [--stages 64] [--micro-batches 512] [--markdown]
"""

from __future__ import annotations

import argparse
import platform
import time

from chimera.schedule import Costs, build_schedule, lower, simulate, validate


def measure(name: str, d: int, n: int) -> dict[str, float]:
    t = {}
    t0 = time.perf_counter()
    s = build_schedule(name, d, n)
    t["generate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    low = lower(s)
    t["lower"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    validate(low)
    t["validate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = simulate(low, Costs(fwd=1, bwd=2))
    t["simulate"] = time.perf_counter() - t0
    t["total"] = sum(t.values())
    t["actions"] = sum(len(row) for row in low.actions)
    t["makespan"] = float(r.makespan)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=512)
    args = ap.parse_args()
    print(f"# simulator scale, D={args.stages}, N={args.micro_batches}, {platform.processor() or platform.machine()}")
    print("| schedule | actions (lowered) | generate s | lower s | validate s | simulate s | total s | goal |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("chimera", "1f1b"):
        t = measure(name, args.stages, args.micro_batches)
        ok = "ok (< 5 s)" if t["total"] < 5 else "MISSED (>= 5 s)"
        print(f"| {name} | {int(t['actions'])} | {t['generate']:.3f} | {t['lower']:.3f} | {t['validate']:.3f} | "
              f"{t['simulate']:.3f} | {t['total']:.3f} | {ok} |")


if __name__ == "__main__":
    main()

"""Steady-state period of consecutive training steps in simulation: for D in {2, 4, ..., 64} x N in {D, 2D, 4D}
with F = I = W = 1, every candidate of ``chimera schedule best`` simulated over ``--steps`` consecutive steps with
the overlapped step boundary (each stage updated as soon as its gradients are summed,
:mod:`chimera.schedule.steps`), and, ranked by period, the split-backward candidates' steps ordered jointly by the
list scheduler, weight gradients free to cross step boundaries (``+joint steps``; simulator-only). Prints, per (D, N), the
fastest candidate by one step's makespan (what ``auto`` picks) with its period, and the fastest by period with
its peak activations (micro-batches per worker) and model shares, against the target period <= 3N + 1 (every
worker computes 3N units a step, so 3N is the floor). The drained period (the runtime's today) is one step's
makespan.

Usage: python bench/period.py [--depths 2,4,8,16,32,64] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chimera.schedule import Costs  # noqa: E402
from chimera.schedule.best import rank  # noqa: E402

EQUAL = Costs(fwd=1, bwd=1, wgrad=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="2,4,8,16,32,64")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    print("| D | N | best by makespan | makespan | its period | best by period | period | its makespan | peak | shares "
          "| 3N + 1 | met | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    missed = []
    for d in (int(x) for x in args.depths.split(",")):
        for n in (d, 2 * d, 4 * d):
            t = time.perf_counter()
            ranked = rank(d, n, EQUAL, steps=args.steps, by="period")
            dt = time.perf_counter() - t
            one = min((c for c in ranked if not c.deferred),  # ties as rank(by="makespan") breaks them
                      key=lambda c: (c.makespan, c.options.get("split_backward", False), c.peak, c.shares))
            per = ranked[0]
            ok = per.period <= 3 * n + 1
            if not ok:
                missed.append((d, n))
            print(f"| {d} | {n} | {one.label} | {float(one.makespan):g} | {float(one.period):g} | {per.label} | "
                  f"{float(per.period):g} | {float(per.makespan):g} | {float(per.peak):g} | {float(per.shares):g} | {3 * n + 1} | {'yes' if ok else 'NO'} | "
                  f"{dt:.1f} |", flush=True)
    print(f"\nperiod <= 3N + 1 (best by period): {'met everywhere' if not missed else f'MISSED at {missed}'}")
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())

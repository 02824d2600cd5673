"""``--schedule auto`` in simulation: for D in {4, 8, 16, 32, 64} x N in {D, 2D, 4D, 8D} with F = B = W, the
schedule ``auto`` picks, its makespan against 1F1B's, and whether it is never slower (the issue's target; the
test suite checks D <= 16, this script the whole grid, about a minute).

Usage: python bench/schedule_auto.py [--depths 4,8,16,32,64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chimera.schedule import Costs, build_schedule, simulate  # noqa: E402
from chimera.schedule.best import best  # noqa: E402

EQUAL = Costs(fwd=1, bwd=1, wgrad=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="4,8,16,32,64")
    args = ap.parse_args()
    print("| D | N | auto's choice | bubble | makespan | 1F1B makespan | auto / 1F1B | search s |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for d in (int(x) for x in args.depths.split(",")):
        for n in (d, 2 * d, 4 * d, 8 * d):
            t = time.perf_counter()
            choice, _ = best(d, n, EQUAL)
            dt = time.perf_counter() - t
            ref = simulate(build_schedule("1f1b", d, n), EQUAL).makespan
            ratio = float(choice.makespan / ref)
            worst = max(worst, ratio)
            print(f"| {d} | {n} | {choice.label} | {float(choice.bubble):.3f} | {float(choice.makespan):g} | "
                  f"{float(ref):g} | {ratio:.3f} | {dt:.1f} |", flush=True)
    print(f"\nslowest auto / 1F1B over the grid: {worst:.3f} (target: < 1): {'met' if worst < 1 else 'MISSED'}")
    return 0 if worst < 1 else 1


if __name__ == "__main__":
    sys.exit(main())

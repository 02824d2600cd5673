"""Offload's cost: step time offloaded / not offloaded for a model that fits, measured side by side, with the
simulator's prediction beside it.

For each offload policy, the same configuration (GPT-2-tiny, Chimera, D = 2, two local workers on CPU) is
trained without and with offload, alternating run by run (``--reps`` pairs); measured = median over the runs
of each run's median step time (max over ranks) over steps 1..n (step 0 warms up). Predicted: the simulator
on the lowered schedule (with and without the swaps), costs from a profile of the model taken the way the
workers run it (one thread per worker, the host <-> device copy links measured with it).

``--baseline-tree PATH``: instead, the step time without offload of this tree against another checkout (e.g.
the commit before offload), each run in a fresh interpreter with that tree first on ``PYTHONPATH``, alternating:
offload must cost nothing when it is off.

Usage: python bench/offload.py [--quick] [--policies optimizer,everything] [--steps 6] [--reps 3]
                               [--baseline-tree PATH] [--results bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chimera.compile import compile_job  # noqa: E402
from chimera.compile.model import preset_chain  # noqa: E402
from chimera.config import TrainConfig  # noqa: E402
from chimera.offload import Offload, ladder  # noqa: E402
from chimera.offload.lowering import lower  # noqa: E402
from chimera.plan import simulator_costs  # noqa: E402
from chimera.profile.layers import profile_chain  # noqa: E402
from chimera.runtime import run_local  # noqa: E402
from chimera.schedule import simulate  # noqa: E402

BASE = dict(model="gpt2-tiny", schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2, seq_len=32,
            optimizer="adamw", corpus="synthetic", partition="uniform", threads=1)


def measured_step(cfg: TrainConfig) -> float:
    """Median step time (max over ranks) of one run, without its first step."""
    metrics = run_local(compile_job(cfg)).metrics
    return statistics.median(m["step_time_s"] for m in metrics[1:])


def predicted_step(cfg: TrainConfig, prof: Any, policy: str, prefetch: int) -> float:
    job = compile_job(cfg)
    costs = simulator_costs(prof, job.stage_layers, job.unit_size, False, job.schedule, "adamw")
    compute_only = job.schedule.compute_only()
    return float(simulate(lower(compute_only, Offload.parse(policy, prefetch)), costs).makespan)


def run(policies: list[str], steps: int, reps: int, prefetch: int) -> list[dict[str, Any]]:
    base = TrainConfig.from_flags(**BASE, steps=steps)
    prof = profile_chain(preset_chain(base), [BASE["micro_batch_size"]], reps=3, warmup=1, threads=1)
    rows = []
    for policy in policies:
        off = base.with_flags(offload=policy, prefetch=prefetch)
        plain_s, off_s = [], []
        for _ in range(reps):  # side by side: the two alternate, so both see the same machine
            plain_s.append(measured_step(base))
            off_s.append(measured_step(off))
        plain, offloaded = statistics.median(plain_s), statistics.median(off_s)
        pred_plain, pred_off = predicted_step(base, prof, "none", prefetch), predicted_step(off, prof, policy, prefetch)
        rows.append({"policy": policy, "prefetch": prefetch, "plain_s": plain, "offload_s": offloaded,
                     "ratio": offloaded / plain, "predicted_ratio": pred_off / pred_plain,
                     "predicted_plain_s": pred_plain, "predicted_offload_s": pred_off})
        r = rows[-1]
        print(f"{policy:22s} measured {plain:.4f} s -> {offloaded:.4f} s (x{r['ratio']:.3f}); "
              f"predicted {pred_plain:.4f} s -> {pred_off:.4f} s (x{r['predicted_ratio']:.3f})", flush=True)
    return rows


_PLAIN = ("import statistics, sys; from chimera.config import TrainConfig; from chimera.runtime import run_local; "
          "m = run_local(TrainConfig.from_flags(**eval(sys.argv[1]))).metrics; "
          "print(statistics.median(x['step_time_s'] for x in m[1:]))")


def baseline(tree: str, steps: int, reps: int) -> str:
    """Median step time without offload, this tree against ``tree``, alternating fresh interpreters."""
    here = str(Path(__file__).resolve().parents[1])
    times: dict[str, list[float]] = {here: [], tree: []}
    for _ in range(reps):
        for t in times:
            env = {**os.environ, "PYTHONPATH": t}
            out = subprocess.run([sys.executable, "-c", _PLAIN, repr({**BASE, "steps": steps})], env=env, cwd=t,
                                 capture_output=True, text=True, check=True).stdout
            times[t].append(float(out.split()[-1]))
    (a, ta), (b, tb) = times.items()
    return (f"| no offload, step s (runs) | this tree | {tree} |\n|---|---|---|\n| median | "
            f"{statistics.median(ta):.4f} ({', '.join(f'{x:.4f}' for x in ta)}) | "
            f"{statistics.median(tb):.4f} ({', '.join(f'{x:.4f}' for x in tb)}) |\n")


def table(rows: list[dict[str, Any]], command: str) -> str:
    lines = [f"`{command}`", "", "| offload | prefetch | no offload s | offloaded s | ratio | predicted ratio |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['policy']} | {r['prefetch']} | {r['plain_s']:.4f} | {r['offload_s']:.4f} | {r['ratio']:.3f} | "
              f"{r['predicted_ratio']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(lv.name for lv in ladder()[1:]))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="one pair per policy, 3 steps")
    p.add_argument("--baseline-tree", default=None, help="compare the step time without offload with this checkout")
    p.add_argument("--results", default=None, help="append the table to this file (e.g. bench/RESULTS.md)")
    a = p.parse_args()
    steps, reps = (3, 1) if a.quick else (a.steps, a.reps)
    command = "python bench/offload.py " + " ".join(sys.argv[1:])
    if a.baseline_tree:
        text = f"`{command}`\n\n" + baseline(a.baseline_tree, steps, max(reps, 3))
    else:
        text = table(run(a.policies.split(","), steps, reps, a.prefetch), command)
    print(text)
    if a.results:
        with open(a.results, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()

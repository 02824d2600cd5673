"""How long the planner takes at scale, and whether its speed-ups keep its answer.

Cases (profiles made of numbers, ``chimera.profile.synthetic``; the arguments ``chimera plan`` passes):

- ``bert48``: BERT-48 paper-like on 32 workers, global batch 256, 16 GiB per worker, LAMB (the CLI's default
  optimizer), every D, top 10 (``chimera plan --model bert-48 --workers 32 --global-batch 256
  --memory-per-worker 16GiB``);
- ``k2048-d64``: a 66-layer model on 2048 workers, global batch 16384, 80 GiB, AdamW, D = 64 (W = 32);
- ``k2048``: the same over every D.

Timing: every run of a case is a fresh Python process (nothing cached from an earlier plan), ``--repeat`` times;
``cold s`` is the wall time from before importing the planner (``chimera.plan``, which no longer pulls in torch) to
its answer, ``cpu s`` that process's CPU time over the plan call alone (steadier than wall time on a shared
machine); the table gives the median and the fastest, and ``warm s`` a second plan in the same process (what the
schedule cache saves). The machine is shared: compare runs made back to back, as ratios.

``--check``: the full ranking of the planner as it runs (bounds prune, schedules cached) against its reference
path (``plan(..., prune=False)``: every candidate built afresh and evaluated): the top list (every field the
table and the plan file show) must be equal, every candidate both evaluated must have the same figures, and no candidate the planner pruned may be in the
reference's top list. ``--save FILE`` writes the top
lists and the reference ranking; ``--against FILE`` compares with such a file written by another version of the
code (e.g. the one before the speed-ups: ``PYTHONPATH=<old tree> python bench/plan_speed.py --save old.json``;
a version without ``prune`` is asked for its unpruned ranking with a top list as long as every candidate).

Usage: python bench/plan_speed.py [--cases bert48,k2048-d64,k2048] [--repeat 3] [--check] [--save F] [--against F]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30
CASES = ("bert48", "k2048-d64", "k2048")


def case(name: str) -> tuple[Any, dict[str, Any]]:
    """The profile and the ``plan`` arguments of a case."""
    from chimera.profile.synthetic import bert48_paper_like, layer, profile

    if name == "bert48":
        return bert48_paper_like(), {"workers": 32, "global_batch": 256, "memory_limit": 16 * GiB,
                                     "optimizer": "lamb", "top": 10}
    sizes = (1, 2, 4, 8)
    big = profile([layer(i, 0.002, 4 * 20_000_000, 10_000_000, 1_000_000, sizes) for i in range(66)], sizes)
    args = {"workers": 2048, "global_batch": 2048 * 8, "memory_limit": 80 * GiB, "optimizer": "adamw", "top": 10}
    if name == "k2048-d64":
        return big, {**args, "stages": 64}
    if name == "k2048":
        return big, args
    raise SystemExit(f"unknown case {name!r}; cases: {', '.join(CASES)}")


def _has_prune() -> bool:
    from chimera.plan import plan

    return "prune" in inspect.signature(plan).parameters


def run(name: str, reference: bool = False) -> Any:
    """Plan a case; ``reference``: every candidate evaluated (no bound, no cache)."""
    from chimera.plan import plan

    prof, args = case(name)
    if not reference:
        return plan(prof, **args)
    if _has_prune():
        return plan(prof, **args, prune=False)
    return plan(prof, **{**args, "top": 10**9})  # before ``prune``: a top list as long as everything prunes nothing


def row(e: Any) -> dict[str, Any]:
    """What the table and the plan file show of one ranked candidate."""
    c = e.candidate
    return {"key": f"{c.label} {json.dumps(c.flags(), sort_keys=True)}", "step_s": e.step_s, "exact": e.exact,
            "bubble": e.bubble, "peak_memory": e.peak_memory, "partition": e.partition,
            "samples_per_s": e.samples_per_s}


def time_case(name: str) -> None:
    """Child process: the cold (and its CPU) and the warm time of one case, as JSON on stdout."""
    t0 = time.perf_counter()
    from chimera.plan import plan

    prof, args = case(name)
    c0 = time.process_time()
    r = plan(prof, **args)
    cpu = time.process_time() - c0
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    run(name)
    warm = time.perf_counter() - t0
    print(json.dumps({"cold": cold, "cpu": cpu, "warm": warm, "ranked": len(r.ranked), "infeasible": len(r.infeasible),
                      "pruned": r.pruned}))


def timings(names: list[str], repeat: int) -> None:
    print("| case | cold s (median) | cold s (fastest) | cpu s (median) | warm s | ranked / infeasible / pruned | goal |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        runs = []
        for _ in range(repeat):
            out = subprocess.run([sys.executable, __file__, "--time-one", name], check=True, capture_output=True,
                                 text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        cold = [r["cold"] for r in runs]
        last = runs[-1]
        med = statistics.median(cold)
        cpu = statistics.median(r["cpu"] for r in runs)
        print(f"| {name} | {med:.2f} | {min(cold):.2f} | {cpu:.2f} | {statistics.median(r['warm'] for r in runs):.2f} | "
              f"{last['ranked']} / {last['infeasible']} / {last['pruned']} | {'ok' if med <= 5 else 'MISSED'} "
              "(<= 5 s) |", flush=True)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a[k] == b[k] for k in a if k != "key")


def check(name: str, top: int, saved: dict[str, Any] | None) -> list[str]:
    """What differs between the planner and its reference path (and the saved version's answer), as lines."""
    fast, ref = run(name), run(name, reference=True)
    bad = []
    mine, theirs = [row(e) for e in fast.ranked[:top]], [row(e) for e in ref.ranked[:top]]
    if mine != theirs:
        bad.append(f"{name}: top {top} differs from the reference: {mine} vs {theirs}")
    full = {r["key"]: r for r in map(row, ref.ranked)}
    ranked = {r["key"]: r for r in map(row, fast.ranked)}
    bad += [f"{name}: {k} differs: {r} vs {full.get(k)}" for k, r in ranked.items() if k not in full or
            not _same(r, full[k])]
    missing = [k for k in full if k not in ranked]
    shown = {r["key"] for r in theirs}
    bad += [f"{name}: {k} was not evaluated but the reference ranks it in its top {top}" for k in missing if k in shown]
    print(f"{name}: top {top} {'equal' if mine == theirs else 'DIFFERENT'}; {len(ranked)} ranked, "
          f"{len(missing)} of the reference's {len(full)} not evaluated (pruned: {fast.pruned}); "
          f"{sum(1 for k in ranked if k in full and _same(ranked[k], full[k]))} with equal figures")
    if saved is not None and name in saved:
        old = saved[name]
        if old["top"] != mine:
            bad.append(f"{name}: top {top} differs from the saved version's: {old['top']} vs {mine}")
        now = sorted((r["step_s"], r["key"]) for r in full.values())
        was = sorted((r["step_s"], r["key"]) for r in old["reference"])
        if now != was or any(not _same(r, full[r["key"]]) for r in old["reference"] if r["key"] in full):
            bad.append(f"{name}: the reference ranking differs from the saved version's")
        print(f"{name}: against the saved version: top {'equal' if old['top'] == mine else 'DIFFERENT'}, "
              f"reference ranking {'equal' if now == was else 'DIFFERENT'} ({len(was)} candidates)")
    return bad


def save(names: list[str], top: int, path: str) -> None:
    out = {name: {"top": [row(e) for e in run(name).ranked[:top]],
                  "reference": [row(e) for e in run(name, reference=True).ranked]} for name in names}
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="compare with the reference path (and --against)")
    ap.add_argument("--no-time", action="store_true", help="skip the timings")
    ap.add_argument("--save", default=None, help="write the top lists and reference rankings to this file")
    ap.add_argument("--against", default=None, help="a file written by --save (another version)")
    ap.add_argument("--time-one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.time_one:
        time_case(args.time_one)
        return
    names = [n for n in args.cases.split(",") if n]
    for n in names:
        case(n)
    if not args.no_time:
        timings(names, args.repeat)
    if args.save:
        save(names, 10, args.save)
    if args.check:
        saved = json.loads(Path(args.against).read_text()) if args.against else None
        bad = [line for n in names for line in check(n, 10, saved)]
        print("\n".join(bad) if bad else "check: same ranking")
        if bad:
            raise SystemExit(1)


if __name__ == "__main__":
    main()

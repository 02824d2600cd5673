"""Budget rows: ``auto`` against the fastest torch.pp schedule that fits the same memory, side by side in one run.

The delay model (sleeps are the compute: forward, input gradient and weight gradient tf per stage) is priced as
if every stage held its share of GPT-2 small: one share of the model (parameters, gradients and AdamW's two
moments, 1/D of 2.43 GiB) weighs ``--weight-units`` micro-batches of one share's activations (GPT-2 small at
B = 1, sequence 1024: 1.39, from the memory model's shapes profile, ``weight_units``). Every schedule of both
systems is priced by the one function ``chimera.schedule.best.footprint`` on the order it runs (torch.pp's
multi-stage rows: the ``pipeline_order`` its schedule object runs, read into chimera's IR; GPipe and 1F1B:
chimera's generator of the same order): peak activations plus shares held x weight units.

Budgets per workload: what torch.pp's 1F1B needs, what its ZBVZeroBubble needs, and unlimited. At each budget
``auto`` is chimera's schedule search (``chimera.schedule.best.best``: every registered candidate simulated with
the delay costs, the fastest that fits by the period of consecutive steps, as the rows are timed; Chimera's halving
mode included: the workloads' delay model sleeps half as long on half a micro-batch) and runs as the schedule it picks; the reference is the fastest *measured* torch.pp row
that fits the same budget. Timing as in ``bench/vs_torch_pipelining.py`` (same runners, the mean of 5 consecutive
steps after a first one, rows rotated per repetition; both sides one process per rank on one machine, gloo, the
same allocator setting and data).

Usage: python bench/budget_rows.py [--quick] [--reps 3] [--warmup 1] [--workloads delay-d4-n4,...]
       [--weight-units 1.39] [--results bench/RESULTS.md | -]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from bench.chimera_runner import ChimeraRow  # noqa: E402
from bench.torchpp_runner import TORCH_SCHEDULES, TorchPPGroup  # noqa: E402
from bench.vs_torch_pipelining import RUN, alternate, steps_per_rep  # noqa: E402
from bench.workloads import WORKLOADS, Workload  # noqa: E402
from chimera.schedule import Costs, build_schedule, from_csv  # noqa: E402
from chimera.schedule.best import Choice, best, footprint  # noqa: E402

DELAY = [n for n, w in WORKLOADS.items() if w.is_delay]
SECTION = "## Budget rows: auto against the fastest torch.pp schedule that fits"


def weight_units(model: str = "gpt2-small", optimizer: str = "adamw") -> float:
    """One share of ``model``'s parameters, gradients and optimizer state, in micro-batches (B = 1) of one share's
    activations, by the memory model's shapes profile (the meta device: nothing is allocated)."""
    from chimera.models import build_model
    from chimera.profile.shapes import shapes_profile

    layers = shapes_profile(build_model(model), 1).layers
    state = sum(2 * la.param_bytes + la.optimizer_bytes[optimizer] for la in layers)
    return state / sum(la.costs[1].stash_bytes for la in layers)


def torch_need(w: Workload, name: str, order: str | None, units: float) -> float:
    """What torch.pp's schedule ``name`` needs per worker (module docstring), from the order it runs."""
    sched = from_csv(order, name=name, microbatches=w.micro_batches) if order else build_schedule(name, w.stages,
                                                                                                   w.micro_batches)
    peak, shares = footprint(sched, TORCH_SCHEDULES[name].per_rank)
    return float(peak + units * shares)


def auto_choice(w: Workload, budget: float | None, units: float, run: int = RUN) -> Choice:
    """``auto``'s pick for the delay model within ``budget`` (None: unlimited), ranked by what the rows time: the
    period of ``run`` consecutive steps after a first one (``bench/predict.py``'s figure). One step's makespan misranks
    schedules whose steps overlap at the boundary (ZB-V's first forwards start while the last weight gradients of
    the step before still run): the runtime lets them overlap, as the benchmark's jobs do not clip. The jointly
    ordered steps (simulator-only) are left out: the row runs the pick's one-step list."""
    assert w.tf is not None
    tf = Fraction(str(w.tf))  # exact: ties between candidates are ties, not float noise
    return best(w.stages, w.micro_batches, Costs(fwd=tf, bwd=tf, wgrad=tf), budget, halving=True,
                layers=2 * w.stages + 2, weight_memory=units, steps=steps_per_rep(run), by="period", joint=False)[0]


def run(w: Workload, units: float, reps: int, warmup: int, log: Any) -> list[dict[str, Any]]:
    """Every budget row of ``w``: start torch.pp (all schedules), price them, pick auto per budget, time all."""
    names = [n for n, ts in TORCH_SCHEDULES.items()
             if not ts.feasible(w.stages, w.micro_batches, w.build(w.stages * ts.per_rank).num_layers)]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(TorchPPGroup(w, names))
        need = {n: torch_need(w, n, group.orders.get(n), units) for n in names}
        torch_rows = [{"system": "torch.pp", "schedule": n, "key": n, "need": need[n], "times": []} for n in names]
        budgets = {"torch 1F1B's": need["1f1b"], "torch ZBV's": need.get("zbvzerobubble"), "unlimited": None}
        picks = {b: auto_choice(w, v, units) for b, v in budgets.items() if v is not None or b == "unlimited"}
        chimera: dict[str, ChimeraRow] = {}
        for c in picks.values():
            if c.label not in chimera:
                row = ChimeraRow(w, c.name, steps_per_rep(RUN) * (warmup + reps), c.options)
                chimera[c.label] = stack.enter_context(row)
        auto_rows = [{"system": "chimera", "schedule": c.label, "key": c.label, "times": [],
                      "need": float(c.peak + units * c.shares)} for c in {c.label: c for c in picks.values()}.values()]
        runners = {("torch.pp", n): group for n in names}
        runners.update({("chimera", k): r for k, r in chimera.items()})
        log(f"  {w.name}: {len(torch_rows)} torch.pp rows, auto picks {sorted(chimera)}")
        alternate(torch_rows + auto_rows, runners, reps, warmup, key="key")
    timed = {r["key"]: statistics.median(r["times"]) for r in torch_rows + auto_rows}
    for b, budget in budgets.items():
        if b not in picks:
            continue
        fits = [r for r in torch_rows if budget is None or r["need"] <= budget + 1e-9]
        ref = min(fits, key=lambda r: timed[r["key"]])
        pick = picks[b]
        rows.append({"workload": w.name, "budget": b, "units": budget, "auto": pick.label,
                     "auto_need": float(pick.peak + units * pick.shares), "auto_s": timed[pick.label],
                     "torch": ref["schedule"], "torch_need": ref["need"], "torch_s": timed[ref["key"]],
                     "fit": ", ".join(r["schedule"] for r in fits), "ratio": timed[pick.label] / timed[ref["key"]]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the budget rows."""
    head = ["workload", "budget (units)", "auto picks (needs)", "auto s", "fastest torch.pp that fits (needs)",
            "torch.pp s", "auto / torch.pp", "torch.pp rows that fit"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        units = "∞" if r["units"] is None else f"{r['units']:.2f}"
        out.append(f"| {r['workload']} | {r['budget']} ({units}) | {r['auto']} ({r['auto_need']:.2f}) | "
                   f"{r['auto_s']:.3f} | {r['torch']} ({r['torch_need']:.2f}) | {r['torch_s']:.3f} | "
                   f"{r['ratio']:.3f} | {r['fit']} |")
    return "\n".join(out)


def checks(rows: list[dict[str, Any]]) -> list[str]:
    """The targets: auto <= 1.00 x the fastest torch.pp that fits at every budget; <= 0.90 at N = D unlimited."""
    out = []
    for r in rows:
        w = WORKLOADS[r["workload"]]
        goal = 0.90 if r["budget"] == "unlimited" and w.micro_batches == w.stages else 1.00
        out.append(f"- {r['workload']} at {r['budget']} budget: {r['ratio']:.3f} (target <= {goal:.2f}): "
                   f"{'ok' if r['ratio'] <= goal else 'MISSED'}")
    return out


def write(path: Path, command: str, body: str) -> None:
    """Replace (or append) this benchmark's section of ``path``."""
    text = path.read_text() if path.exists() else ""
    section = f"{SECTION}\n\n`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n{body}\n"
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("" if end < 0 else text[end + 1:])
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one measured repetition and one warm-up")
    ap.add_argument("--workloads", default=",".join(DELAY), help=f"comma-separated subset of {', '.join(DELAY)}")
    ap.add_argument("--weight-units", type=float, default=None, help="default: GPT-2 small's (weight_units())")
    ap.add_argument("--results", default=str(Path(__file__).with_name("RESULTS.md")), help="'-': do not write")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    if not set(names) <= set(DELAY):
        ap.error(f"unknown or non-delay workload(s) {sorted(set(names) - set(DELAY))}; known: {', '.join(DELAY)}")
    reps, warmup = (1, 1) if args.quick else (args.reps, args.warmup)
    units = args.weight_units if args.weight_units is not None else weight_units()
    command = "python bench/budget_rows.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    workloads = [WORKLOADS[n] for n in names]
    ray.init(address="local", num_cpus=3 * max(w.stages for w in workloads) + 2, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        for w in workloads:
            rows += run(w, units, reps, warmup, lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        ray.shutdown()
    body = (f"{reps} measured + {warmup} warm-up repetitions per row, {time.perf_counter() - t0:.0f} s; one share "
            f"of weights, gradients and AdamW state = {units:.2f} micro-batches of activations (GPT-2 small, B = 1)."
            f"\n\n{table(rows)}\n\n" + "\n".join(checks(rows)))
    print(body)
    if args.results != "-":
        write(Path(args.results), command, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

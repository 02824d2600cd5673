"""chimera on Ray vs torch.distributed.pipelining on identical work, alternating A/B in one run.

For every workload (delay model: forward sleeps tf, input gradient tf, weight gradient tf per stage, so
zero-bubble schedules on both sides get the W work they move; tiny BERT with one thread per worker) this
starts, once, one torch.pp process group (gloo, torch.multiprocessing forkserver, one process per rank
hosting GPipe, 1F1B, Interleaved1F1B, DualPipeV, ZBVZeroBubble, InterleavedZeroBubble and LoopedBFS, the
last four with two stages per rank) and one chimera RayJob per schedule (Chimera, 1F1B, GPipe, and ``auto``,
labelled with the schedule it chose) on one local Ray. Both sides use chimera's CPU allocator setting
(``keep_freed_memory``) and its cores (``--cpu-affinity auto``). Where they differ: each side moves messages its
own way, torch.pp through gloo and chimera through shared memory between processes of one host (its default
``--p2p auto``); the output says so.
Each repetition then runs two steps of every row back to back, rows in an order rotated by one per repetition so
drift hits all rows alike; the first ``--warmup`` repetitions are discarded.

Step time, the same definition for both systems: each repetition runs one step and then ``--run-steps`` (5)
consecutive steps; a row's step time is the mean of those, from all workers done with the first step to all
workers done with the last, optimizer steps included, and nothing between the steps (torch.pp: rank 0 between
the barriers that end the first step and the last, no barrier between the steps; chimera: the Ray driver
between the first step's results and the last's, the consecutive steps run back to back in one call on each
actor, ``RayJob.steps(..., per_call=)``). A worker that finishes a step starts the next at once on both sides,
so a schedule whose workers idle at the start and the end of a step may overlap consecutive steps. Predictions:
the simulator's period of consecutive steps (``chimera.schedule.steps``) on the same schedule
(``bench/predict.py``), chimera's rows with the runtime's costs as calibrated right before and right after the
rows' steps (their mean). Ratios: to torch.pp's 1F1B and to the fastest torch.pp row of the workload.

Usage: python bench/vs_torch_pipelining.py [--reps 5] [--quick] [--workloads delay-d4-n4,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from bench.chimera_runner import ChimeraRow, peak_rss_mib, row_p2p, run_on_ray  # noqa: E402
from bench.predict import CALIBRATION_STEPS, Calibration, predicted_step_s  # noqa: E402
from bench.report import format_table, targets, write_results  # noqa: E402
from bench.torchpp_runner import TORCH_SCHEDULES, TorchPPGroup  # noqa: E402
from bench.workloads import WORKLOADS, Workload  # noqa: E402
from chimera.schedule import from_csv  # noqa: E402
from chimera.schedule.registry import SCHEDULES  # noqa: E402
from chimera.schedule.registry import get as schedule_spec  # noqa: E402

CHIMERA_SCHEDULES = ["chimera", "1f1b", "gpipe", "auto"]
RUN = 5  # consecutive steps timed per row and repetition (after one untimed step): --run-steps
#: --quick: steps per calibration run (a noisier per-step remainder, half the time), one calibration (before the rows)
QUICK_CALIBRATION_STEPS = 12


def steps_per_rep(run: int) -> int:
    """Steps one repetition of a row runs: one untimed, then ``run`` timed back to back."""
    return 1 + run


def rows_of(w: Workload, only: set[str] | None = None) -> list[dict[str, Any]]:
    """Every (system, schedule) row of workload ``w`` (``only``: those schedule names, and torch.pp's 1F1B, the
    reference of every ratio); infeasible ones carry a ``note`` and no timings."""
    rows = []
    for name, ts in TORCH_SCHEDULES.items():
        if only is not None and name not in only | {"1f1b"}:
            continue
        why = ts.feasible(w.stages, w.micro_batches, w.build(w.stages * ts.per_rank).num_layers)
        split = f"{w.stages * ts.per_rank} ({ts.per_rank}/rank{', V' if ts.style == 'v' and ts.per_rank == 2 else ''})"
        rows.append({"system": "torch.pp", "schedule": name, "split": split, "note": why or ""})
    extra = [n for n in sorted(only or ()) if n not in CHIMERA_SCHEDULES and n not in TORCH_SCHEDULES]
    for name in [*CHIMERA_SCHEDULES, *extra]:  # --schedules may name any other registered schedule
        if only is not None and name not in only:
            continue
        base = row_p2p(name)[0]
        if base in ("chimera", "1f1b", "gpipe", "auto"):
            split = f"{w.stages} (2/rank, replicas)" if base == "chimera" else f"{w.stages} (1/rank)"
        else:
            spec = schedule_spec(base)
            parts, held = spec.parts(w.stages, {}), spec.shares * spec.chunks_of({})
            split = f"{parts} ({held}/rank{', replicas' if held > spec.chunks_of({}) else ''})"
        rows.append({"system": "chimera", "schedule": name, "split": split, "note": ""})
    for r in rows:
        r.update(workload=w.name, stages=w.stages, micro_batches=w.micro_batches, times=[])
    return rows


def run_workload(w: Workload, reps: int, warmup: int, log: Any, only: set[str] | None = None,
                 calibrate: bool = False, run: int = RUN, calibration_steps: int = CALIBRATION_STEPS,
                 bracket: bool = True) -> tuple[list[dict[str, Any]], Calibration | None]:
    """Start both systems for ``w``, alternate steps over the rows, return the rows with their times and, with
    ``calibrate`` (a delay workload), the runtime's costs measured for ``w`` once its rows are up
    (:func:`calibrate_for`, ``calibration_steps`` per calibration run): the mean of one calibration right before
    the rows' steps and one right after them (:meth:`Calibration.mean`), or with ``bracket`` False (``--quick``)
    the one before."""
    rows = rows_of(w, only)
    live = [r for r in rows if not r["note"]]
    torch_names = [r["schedule"] for r in live if r["system"] == "torch.pp"]
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(4) as pool:
        # start the chimera jobs in threads, so all actors import torch while the torch.pp group starts
        chimera_rows = {r["schedule"]: ChimeraRow(w, r["schedule"], steps_per_rep(run) * (warmup + reps)) for r in live
                        if r["system"] == "chimera"}
        for c in chimera_rows.values():
            stack.callback(c.__exit__, None, None, None)
        futures = [pool.submit(c.__enter__) for c in chimera_rows.values()]
        group = stack.enter_context(TorchPPGroup(w, torch_names))
        for f in futures:
            f.result()
        for r in live:
            order = group.orders.get(r["schedule"]) if r["system"] == "torch.pp" else None
            if order is not None:  # what torch runs, simulated like every other row
                sched = from_csv(order, name=r["schedule"], microbatches=w.micro_batches)
                r["predicted_step_s"] = predicted_step_s(w, "torch.pp", r["schedule"], sched, run=run)
        runners: dict[tuple[str, str], Any] = {("torch.pp", n): group for n in torch_names}
        runners.update({("chimera", n): c for n, c in chimera_rows.items()})
        log(f"  {w.name}: started {len(live)} rows in {time.perf_counter() - t_start:.1f} s")
        calibrate = calibrate and w.is_delay
        calibration = calibrate_for(w, log, calibration_steps, "before the rows") if calibrate else None
        alternate(live, runners, reps, warmup, run=run)
        if calibration is not None and bracket:
            calibration = calibration.mean(calibrate_for(w, log, calibration_steps, "after the rows"))
        for r in live:
            runner = runners[(r["system"], r["schedule"])]
            r["peak_rss_mib"] = peak_rss_mib(runner.pids)
            if r["system"] == "chimera":
                r["worker_step_s"] = statistics.median(runner.worker_times[warmup:])
                # an @gloo row is not predicted: the calibration measured the default transport
                r["predicted_step_s"] = None if "@" in r["schedule"] else predicted_step_s(
                    w, "chimera", r["schedule"], runner.job.job.schedule, calibration, run=run)
                if r["schedule"] == "auto":  # labelled with what it chose
                    r["schedule"] = f"auto: {runner.label}"
                    chosen = runner.job.job.schedule
                    r["split"] = f"{w.stages} ({len(chosen.stages_of(0))}/rank{', replicas' if chosen.bidirectional else ''})"
    log(f"  {w.name}: done in {time.perf_counter() - t_start:.1f} s")
    return rows, calibration


def calibrate_for(w: Workload, log: Any, steps: int = CALIBRATION_STEPS, when: str = "") -> Calibration:
    """The runtime's costs for delay workload ``w`` (its D workers, sleeping like its actions), measured while its
    rows' processes are up and idle, as they are while any one row runs: the idle actors' own wake-ups and
    threads (56 of them for seven rows at D = 8) load the two cores the rows run on, and a calibration taken before
    they start misses that. Its jobs run on Ray as the rows do (:func:`~bench.chimera_runner.run_on_ray`): a Ray
    actor's step costs more than a local process's (~4 ms of ~83 at tf = 2 ms on the development machine)."""
    t0 = time.perf_counter()
    calibration = Calibration.measure(w.stages, float(w.tf or 0.0), steps, launch=run_on_ray)
    log(f"  {w.name}: calibration in {time.perf_counter() - t0:.1f} s{f' ({when})' if when else ''}: "
        f"{calibration.text()}")
    return calibration


def alternate(live: list[dict[str, Any]], runners: dict[tuple[str, str], Any], reps: int, warmup: int,
              key: str = "schedule", run: int = RUN) -> None:
    """``warmup + reps`` repetitions of one step and ``run`` consecutive timed steps of every row
    (``runners[(system, row[key])]``), the rows in an order rotated by one per repetition; the timed steps' mean of
    each measured repetition joins its row's ``times``."""
    for k in range(warmup + reps):
        order = live[k % len(live):] + live[:k % len(live)]
        for r in order:
            runner = runners[(r["system"], r[key])]
            n = steps_per_rep(run)
            steps = [n * k + i for i in range(n)]
            dt = runner.steps(r["schedule"], steps) if r["system"] == "torch.pp" else runner.steps(steps)
            if k >= warmup:
                r["times"].append(dt)


def finish(rows: list[dict[str, Any]], w: Workload) -> None:
    """Medians, samples/s, ratios to torch.pp 1F1B and to the fastest torch.pp row, predictions, in place."""
    for r in rows:
        r["median_step_s"] = statistics.median(r["times"]) if r["times"] else None
        samples = w.micro_batches * w.micro_batch_size
        r["samples_per_s"] = samples / r["median_step_s"] if r["median_step_s"] else None
        if r["system"] == "torch.pp" and "predicted_step_s" not in r:
            r["predicted_step_s"] = None if r["note"] else predicted_step_s(w, r["system"], r["schedule"])
        r.setdefault("predicted_step_s", None)
    ref = next(r["median_step_s"] for r in rows if r["system"] == "torch.pp" and r["schedule"] == "1f1b")
    best = min((r["median_step_s"] for r in rows if r["system"] == "torch.pp" and r["median_step_s"]), default=None)
    for r in rows:
        r["ratio_to_torch_1f1b"] = r["median_step_s"] / ref if r["median_step_s"] and ref else None
        r["ratio_to_torch_best"] = r["median_step_s"] / best if r["median_step_s"] and best else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions per row")
    ap.add_argument("--warmup", type=int, default=2, help="discarded repetitions per row")
    ap.add_argument("--quick", action="store_true",
                    help="one measured repetition (and one warm-up) per row; one calibration, before the rows, of "
                         f"{QUICK_CALIBRATION_STEPS} steps per run")
    ap.add_argument("--run-steps", type=int, default=RUN,
                    help="consecutive steps timed per repetition, after one untimed step (their mean is the step time)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    ap.add_argument("--schedules", default=None,
                    help="only these schedules, comma-separated (both systems; torch.pp 1f1b always runs: the reference; "
                         "any other registered chimera schedule, e.g. bitpipe or zb-v, adds a chimera row; NAME@gloo "
                         "adds chimera's NAME with its messages through gloo, e.g. 1f1b@gloo, not predicted)")
    ap.add_argument("--tf", type=float, default=None, help="delay model forward seconds per stage (default 0.05)")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="predict chimera rows from the schedule alone (no measured runtime costs)")
    ap.add_argument("--json", default=None, help="write the rows as a JSON list to this path")
    ap.add_argument("--results", default=str(Path(__file__).with_name("RESULTS.md")),
                    help="markdown file to update with the table ('-': do not write)")
    args = ap.parse_args(argv)
    if args.run_steps < 1:
        ap.error(f"--run-steps must be >= 1, got {args.run_steps}")
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    reps, warmup = (1, 1) if args.quick else (args.reps, args.warmup)
    only = {x.strip() for x in args.schedules.split(",") if x.strip()} if args.schedules else None
    known = {*TORCH_SCHEDULES, *CHIMERA_SCHEDULES, *SCHEDULES}
    bad = sorted(x for x in only or () if row_p2p(x)[0] not in known)
    if bad:
        ap.error(f"unknown schedule(s) {bad}; known: {', '.join(sorted(known))} (chimera's, also as NAME@gloo)")
    workloads = [WORKLOADS[n] for n in names]
    workloads = [w.with_plan(w.stages, 2 * w.stages) for w in workloads]  # planned splits (uniform: as is)
    if args.tf is not None:
        from dataclasses import replace
        workloads = [replace(w, tf=args.tf) if w.is_delay else w for w in workloads]
    command = "python bench/vs_torch_pipelining.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    rows_per = len({*CHIMERA_SCHEDULES, *((only or set()) - set(TORCH_SCHEDULES))})
    cpus = (rows_per + 1) * max(w.stages for w in workloads) + 2  # one CPU slot per chimera worker, the calibration's
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    all_rows: list[dict[str, Any]] = []
    calibrations: list[str] = []
    t0 = time.perf_counter()
    try:
        for w in workloads:
            rows, calibration = run_workload(w, reps, warmup, log, only, not args.no_calibrate, args.run_steps,
                                             QUICK_CALIBRATION_STEPS if args.quick else CALIBRATION_STEPS,
                                             bracket=not args.quick)
            finish(rows, w)
            all_rows.extend(rows)
            if calibration is not None:
                when = "before" if args.quick else "mean of one before and one after"
                calibrations.append(f"- calibration, {w.name} (its rows up: {when} their steps): {calibration.text()}")
    finally:
        ray.shutdown()
    header = (f"# vs torch.distributed.pipelining: {reps} measured + {warmup} warm-up repetitions per row, "
              f"{time.perf_counter() - t0:.0f} s; messages: torch.pp through gloo, chimera through shared memory "
              "(its --p2p auto; gloo beyond 256 KiB)")
    table = format_table(all_rows)
    checks = targets(all_rows, tf=workloads[0].tf if workloads[0].is_delay else None)
    checks[:0] = calibrations
    print(header)
    print(table)
    print("\n".join(checks))
    out_rows = [{k: v for k, v in r.items()} for r in all_rows]
    if args.json:
        Path(args.json).write_text(json.dumps(out_rows, indent=1) + "\n")
    if args.results != "-":
        write_results(Path(args.results), command, workloads, reps, warmup, table, checks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

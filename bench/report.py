"""Table, target checks and the ``bench/RESULTS.md`` section of ``bench/vs_torch_pipelining.py``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.workloads import Workload

SECTION = "## chimera vs torch.distributed.pipelining"
COLUMNS = ["workload", "system", "schedule", "stages (split)", "N", "median step s", "samples/s",
           "ratio to torch.pp 1F1B", "ratio to best torch.pp", "predicted s", "measured / predicted", "peak RSS MiB/worker", "note"]


def _f(v: float | None, fmt: str = ".3f") -> str:
    return "—" if v is None else format(v, fmt)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of all rows."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        m, p = r.get("median_step_s"), r.get("predicted_step_s")
        cells = [r["workload"], r["system"], r["schedule"], f"{r['stages']} ({r['split']})", str(r["micro_batches"]),
                 _f(m), _f(r.get("samples_per_s"), ".1f"), _f(r.get("ratio_to_torch_1f1b")),
                 _f(r.get("ratio_to_torch_best")), _f(p),
                 _f(m / p if m and p else None), _f(r.get("peak_rss_mib"), ".0f"), r["note"] or ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _row(rows: list[dict[str, Any]], workload: str, system: str, schedule: str) -> dict[str, Any] | None:
    return next((r for r in rows if (r["workload"], r["system"], r["schedule"]) == (workload, system, schedule)), None)


def _predicted_ratio(rows: list[dict[str, Any]], r: dict[str, Any]) -> str:
    """The same ratio as the simulator predicts it (both schedules free of runtime overhead), when both rows have a
    prediction: what the schedules alone allow."""
    timed = [t for t in rows if t["workload"] == r["workload"] and t["system"] == "torch.pp" and t["median_step_s"]]
    fastest = min(timed, key=lambda t: t["median_step_s"], default=None)
    if not fastest or not fastest["predicted_step_s"] or not r["predicted_step_s"]:
        return ""
    return (f"; predicted {r['predicted_step_s']:.3f} / {fastest['predicted_step_s']:.3f} ({fastest['schedule']}) = "
            f"{r['predicted_step_s'] / fastest['predicted_step_s']:.3f}")


def targets(rows: list[dict[str, Any]], tf: float | None = None) -> list[str]:
    """One line per target: ok or MISSED with the figures. ``tf``: the delay model's forward seconds; with short
    actions (tf <= 2 ms) chimera's 1F1B must beat torch.pp's by 5 % (the same schedule: the runtimes alone)."""
    out = []
    r = _row(rows, "delay-d4-n4", "chimera", "chimera")
    if r and r["ratio_to_torch_1f1b"] is not None:
        ok = r["ratio_to_torch_1f1b"] <= 0.77
        out.append(f"- delay-d4-n4: chimera Chimera / torch.pp 1F1B = {r['ratio_to_torch_1f1b']:.3f} (target <= 0.77, "
                   f"theory 0.76): {'ok' if ok else 'MISSED'}")
    for w in dict.fromkeys(r["workload"] for r in rows):
        c = _row(rows, w, "chimera", "1f1b")
        if c and c["ratio_to_torch_1f1b"] is not None:
            goal = 0.95 if tf is not None and tf <= 0.002 and w.startswith("delay") else 1.03
            ok = c["ratio_to_torch_1f1b"] <= goal
            out.append(f"- {w}: chimera 1F1B / torch.pp 1F1B = {c['ratio_to_torch_1f1b']:.3f} (target <= {goal:.2f}): "
                       f"{'ok' if ok else 'MISSED'}")
    for r in rows:
        if r["system"] == "chimera" and r["schedule"].startswith("auto") and r["workload"].startswith("delay") \
                and r["ratio_to_torch_best"] is not None:
            goal = 0.90 if r["stages"] == r["micro_batches"] else 1.00
            out.append(f"- {r['workload']}: chimera {r['schedule']} / best torch.pp = {r['ratio_to_torch_best']:.3f} "
                       f"(target <= {goal:.2f}): {'ok' if r['ratio_to_torch_best'] <= goal else 'MISSED'}"
                       + _predicted_ratio(rows, r))
    for r in rows:
        if r["system"] == "chimera" and r["workload"].startswith("delay") and r["median_step_s"] and r["predicted_step_s"]:
            dev = r["median_step_s"] / r["predicted_step_s"] - 1
            out.append(f"- {r['workload']} {r['system']} {r['schedule']}: measured / predicted - 1 = {dev:+.3f} "
                       f"(target within ±0.03): {'ok' if abs(dev) <= 0.03 else 'MISSED'}")
    return out


def write_results(path: Path, command: str, workloads: list[Workload], reps: int, warmup: int, table: str,
                  checks: list[str], notes: str = "") -> None:
    """Replace (or append) this benchmark's section of ``path``; other sections stay as they are."""
    desc = ", ".join(f"{w.name} ({w.model}, D={w.stages}, N={w.micro_batches}, B={w.micro_batch_size}"
                     + (f", tf={w.tf:g} s" if w.is_delay else f", seq {w.seq_len}")
                     + "".join(f", {k} stages: layers {w.sizes(k)}" for k, _ in w.planned) + ")" for w in workloads)
    body = (f"{SECTION} (`bench/vs_torch_pipelining.py`)\n\n"
            f"Command: `{command}`\n\n"
            f"Workloads: {desc}. {reps} measured repetitions per row after {warmup} warm-up; each repetition "
            "runs two steps of every row back to back, rows alternating in rotating order; median step time. "
            "Step time for both systems: the second step of the pair, from all workers done with the first to "
            "all workers done with the second, including the optimizer step (torch.pp: rank 0 between the "
            "barriers ending the two steps; chimera: the Ray driver between the two results, the second step "
            "queued on the actors while the first runs, as `ray_launch.driver.run` trains). One thread "
            "per worker on both sides, and the same CPU allocator setting (chimera's `keep_freed_memory`: freed "
            "memory stays on the heap) and garbage collection (chimera's `StepCollector`: Python's collector "
            "after every step, inside its timed window, never during one) in chimera's workers and torch.pp's "
            "processes, pinned alike (chimera's `--cpu-affinity auto`: where a side's ranks fill the cores, each "
            "rank on its own, round robin by rank). Where they differ: messages between workers go through gloo "
            "on torch.pp's side and "
            "through shared memory on chimera's (its default `--p2p auto`; gloo beyond 256 KiB). "
            "chimera's `auto` row is "
            "labelled with the schedule it chose; on the delay model it runs the split into 2·D blocks of tf/2 "
            "(the split of torch.pp's two-stages-per-rank rows), so that it can choose 2·D-stage schedules too. Peak RSS: the largest VmHWM among a row's workers (the torch.pp processes "
            "host all seven torch schedules of a workload, so their rows share one figure).\n\n"
            f"{table}\n\nTargets:\n\n" + "\n".join(checks) + "\n" + (f"\n{notes}\n" if notes else ""))
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)} \(`bench/vs_torch_pipelining.py`\).*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: body + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + body
    path.write_text(text)

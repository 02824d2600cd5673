"""GPU check of offload under NCCL (issue 28): ``--offload everything`` trains like no offload, and what it costs.

One worker per GPU (NCCL refuses two ranks on one device; ``run_local`` gives rank r the GPU r):

* two or more GPUs visible: Chimera, D = 2, W = 1. Both replicas of each stage sum their offloaded gradients over
  host buffers on the gloo host groups while activations, gradients between stages and the global norm go over
  NCCL (the record's ``group_ops`` shows which groups carried what);
* one GPU: one stage (1F1B, D = 1, W = 1). The host store's pinned copies, the copy stream, weight packs and the
  optimizer step on the host run under NCCL; no gradient sum between replicas (there is no other replica).

Policies, each trained from the same seed on the same data: ``none``, ``everything`` (whole stages) and
``everything`` in packs of one layer. The first repetition returns every parameter: each offloaded run must be
within ``--tolerance`` of the run without offload, parameter by parameter, and its losses too. Then the runs
alternate (``--reps``) and the median step time (max over ranks, steps 1.. of each run) is reported with its ratio
to no offload. The table goes to stdout and, with ``--results``, is appended to that file. Exit status 1 when
parity fails.

Usage: python bench/gpu_offload_check.py [--model gpt2-small] [--seq-len 128] [-B 4] [-N 4] [--steps 5] [--reps 2]
                                        [--results bench/RESULTS.md] [--cpu]   (--cpu: the same on gloo, a smoke run)
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from chimera.compile import compile_job  # noqa: E402
from chimera.config import TrainConfig  # noqa: E402
from chimera.runtime import run_local  # noqa: E402

POLICIES = {"none": {"offload": "none"}, "everything": {"offload": "everything"},
            "everything, packs of 1": {"offload": "everything", "offload_pack": 1}}


def base_config(a: argparse.Namespace) -> TrainConfig:
    device = "cpu" if a.cpu else "cuda"
    gpus = 0 if a.cpu else torch.cuda.device_count()
    two = a.cpu or gpus >= 2
    return TrainConfig.from_flags(model=a.model, seq_len=a.seq_len, micro_batch_size=a.micro_batch_size,
                                  micro_batches=a.micro_batches, steps=a.steps, device=device, optimizer="adamw",
                                  corpus="synthetic", partition="uniform", schedule="chimera" if two else "1f1b",
                                  stages=2 if two else 1, data_parallel=1, timeout_s=600)


def max_diff(a: dict[int, Any], b: dict[int, Any]) -> float:
    return max((a[r][k][n] - b[r][k][n]).abs().max().item() for r in a for k in a[r] for n in a[r][k])


def run(cfg: TrainConfig, state: bool) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    res = run_local(compile_job(cfg), return_state=state)
    return res.metrics, res.states


def check(a: argparse.Namespace) -> tuple[str, bool]:
    base = base_config(a)
    ref_metrics, ref_state = run(base, True)
    rows, ok = [], True
    first: dict[str, tuple[list[dict[str, Any]], dict[int, Any]]] = {"none": (ref_metrics, ref_state)}
    for name, flags in POLICIES.items():
        if name != "none":
            first[name] = run(base.with_flags(**flags), True)
    times: dict[str, list[float]] = {name: [statistics.median(m["step_time_s"] for m in first[name][0][1:])]
                                     for name in POLICIES}
    for _ in range(a.reps - 1):  # alternating, so every policy sees the same machine
        for name, flags in POLICIES.items():
            metrics, _ = run(base.with_flags(**flags), False)
            times[name].append(statistics.median(m["step_time_s"] for m in metrics[1:]))
    plain = statistics.median(times["none"])
    for name in POLICIES:
        metrics, state = first[name]
        diff = max_diff(ref_state, state)
        loss = max(abs(m["loss"] - r["loss"]) for m, r in zip(metrics, ref_metrics))
        good = diff <= a.tolerance and loss <= a.tolerance
        ok &= good
        step = statistics.median(times[name])
        rows.append(f"| {name} | {step:.4f} ({', '.join(f'{t:.4f}' for t in times[name])}) | {step / plain:.3f} | "
                    f"{diff:.2e} | {loss:.2e} | {'ok' if good else 'FAIL'} | {metrics[-1].get('group_ops', {})} |")
    return "\n".join(header(a, base) + rows) + "\n", ok


def header(a: argparse.Namespace, cfg: TrainConfig) -> list[str]:
    s = cfg.schedule
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except OSError:
        commit = "?"
    gpu = torch.cuda.get_device_name(0) if not a.cpu else "none (gloo on CPU, smoke run)"
    version = torch.cuda.nccl.version() if not a.cpu else "-"
    nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    return [f"`python bench/gpu_offload_check.py {' '.join(sys.argv[1:])}` ({when}, commit {commit}; {gpu}, torch "
            f"{torch.__version__}, NCCL {nccl})", "",
            f"{a.model}, {s.name}, D = {s.stages}, W = 1, N = {s.micro_batches}, B = {s.micro_batch_size}, sequence "
            f"{a.seq_len}, {a.steps} steps, AdamW; step time: median over steps 1.. of each run, median over {a.reps} "
            "runs; parity: the first run of each policy against the first without offload.", "",
            "| offload | step s (runs) | x no offload | max parameter diff | max loss diff | parity | group ops, last "
            "step |", "|---|---|---|---|---|---|---|"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("-B", "--micro-batch-size", type=int, default=4)
    p.add_argument("-N", "--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--results", default=None, help="append the table to this file (e.g. bench/RESULTS.md)")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo): a smoke run of this script")
    a = p.parse_args()
    if not a.cpu and not torch.cuda.is_available():
        sys.exit("no GPU visible: this is the GPU check (--cpu runs its smoke on CPU)")
    text, ok = check(a)
    print(text)
    if a.results:
        with open(a.results, "a") as f:
            f.write("\n" + text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

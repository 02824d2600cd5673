"""Simulator predictions for the rows of ``bench/vs_torch_pipelining.py``.

Delay model: F = tf, B = 2·tf per stage (tf/2 and tf for the 2·D-stage splits), no communication cost.
Real models: per-stage F and B of one micro-batch profiled in this process with one thread (median of
5 after a warm-up), the same split the row uses. The optimizer step and communication are not modelled.
DualPipeV has no chimera generator, so it gets no prediction.
"""

from __future__ import annotations

import statistics
import time
from functools import cache

import torch

from bench.workloads import Workload
from chimera.data import build_dataset
from chimera.models import build_stage, partition
from chimera.schedule import Costs, build_schedule, simulate


@cache
def profile_stages(w: Workload, parts: int, reps: int = 5) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Median forward and backward seconds of one micro-batch for each of the ``parts`` stages (1 thread)."""
    model = w.build(parts)
    stages = [build_stage(model, idx, w.seed) for idx in partition(model, parts)]
    inputs, labels = build_dataset(model, w.micro_batch_size, w.seq_len, w.seed).get(0, 0, 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fwd: list[list[float]] = [[] for _ in stages]
    bwd: list[list[float]] = [[] for _ in stages]
    try:
        for rep in range(reps + 1):
            acts, saved = None, []
            for s, mod in enumerate(stages):
                x = None if acts is None else tuple(t.detach().requires_grad_(t.is_floating_point()) for t in acts)
                t0 = time.perf_counter()
                out = mod(x, inputs=inputs, labels=labels)
                if rep:
                    fwd[s].append(time.perf_counter() - t0)
                saved.append((x, out))
                acts = None if mod.is_last else out
            grads = None
            for s in reversed(range(len(stages))):
                x, out = saved[s]
                t0 = time.perf_counter()
                if grads is None:
                    out.backward()
                else:
                    outs = [t for t in out if t.requires_grad]
                    torch.autograd.backward(outs, list(grads))
                if rep:
                    bwd[s].append(time.perf_counter() - t0)
                grads = None if x is None else tuple(t.grad for t in x if t.is_floating_point())
            for mod in stages:
                mod.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return tuple(statistics.median(v) for v in fwd), tuple(statistics.median(v) for v in bwd)


def predicted_step_s(w: Workload, system: str, schedule: str) -> float | None:
    """The simulator's makespan for the row, or None (DualPipeV)."""
    if schedule == "dualpipev":
        return None
    interleaved = system == "torch.pp" and schedule == "interleaved1f1b"
    parts = 2 * w.stages if interleaved else w.stages
    if w.is_delay:
        assert w.tf is not None
        tf = w.tf * w.stages / parts
        costs = Costs(fwd=tf, bwd=2 * tf)
    else:
        f, b = profile_stages(w, parts)
        costs = Costs(fwd=list(f), bwd=list(b))
    sched = build_schedule("interleaved" if interleaved else schedule, w.stages, w.micro_batches, chunks=2)
    return float(simulate(sched, costs).makespan)

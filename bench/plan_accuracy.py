"""How well the planner predicts: predicted vs measured step time of planned configurations, side by side.

1. ``accuracy``: BERT-tiny and GPT-2-tiny at D = 2 (two workers on the two cores, one thread each). The model is
   profiled as the workers run it (one thread, the unit sizes asked), the planner ranks the configurations for
   2 workers and a global batch, and the best four are trained with ``run_local``; measured = median of the
   workers' step time (max over ranks) over steps 2..n. The machine's speed drifts (up to 1.5x within minutes
   on a small virtual machine), so in each of ``--rounds`` rounds every configuration is profiled again right
   before and right after it is trained (the prediction: the mean of the two), and the check reads the median
   of the per-round ratios.
2. ``heavy``: a chain of sleeping layers, one of them five times heavier: the planned partition against the
   uniform one (1F1B, D = 2): measured margin vs the simulator's predicted margin. Sleeping layers make the
   step independent of how the two cores are shared.
3. ``breakdown``: where the time goes, BERT-tiny at D = 2 (the planner's best configuration, timed by the runtime's
   own events): per worker and action kind, predicted vs measured seconds per step.
4. ``default``: the default job (BERT-mini, Chimera, D = N = 4) on Ray with the uniform and the planned
   partition: measured utilization (1 - bubble, from the runtime's own timeline) and the simulated ideal.

Usage: python bench/plan_accuracy.py [--parts accuracy,heavy,breakdown,default] [--steps 6] [--reps 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from chimera.compile import compile_job  # noqa: E402
from chimera.config import TrainConfig  # noqa: E402
from chimera.job import Prediction  # noqa: E402
from chimera.models import LayerChain, build_model  # noqa: E402
from chimera.plan import plan, plan_partition, simulator_costs  # noqa: E402
from chimera.plan.partition import layers_of  # noqa: E402
from chimera.plan.planfile import plan_flags  # noqa: E402
from chimera.plan.profiles import cached_profile, sharing  # noqa: E402
from chimera.profile.comm import measure_comm_local  # noqa: E402
from chimera.profile.layers import profile_chain  # noqa: E402
from chimera.runtime import run_local  # noqa: E402
from chimera.schedule import build_schedule, lower, simulate  # noqa: E402


def measured_step(cfg: TrainConfig) -> float:
    """Median over steps 2.. of the slowest worker's step time, under run_local."""
    res = run_local(compile_job(cfg))
    return statistics.median(m["step_time_s"] for m in res.metrics[2:])


def simulated(prof: Any, job: Any) -> Any:
    """The simulator's run of exactly this job (schedule, partition, recomputation, optimizer) under ``prof``."""
    t = job.run
    return simulate(job.schedule, simulator_costs(prof, job.stage_layers, job.unit_size, t.recompute, job.schedule,
                                                  t.optimizer, clip=t.clip_grad > 0))


def predicted_step(chain: LayerChain, job: Any, reps: int, comm: Any) -> float:
    """A fresh profile at the job's unit size (two processes in lock-step, as its two workers), simulated."""
    prof = profile_chain(chain, [job.unit_size], reps=reps, warmup=2, threads=1, comm=comm, concurrent=2)
    return float(simulated(prof, job).makespan)


def accuracy(steps: int, reps: int, rounds: int) -> list[str]:
    """Predicted vs measured for the planner's best four configurations per model, in ``rounds`` rounds. The
    configurations are planned once, from a first profile; then every round profiles each configuration (its own
    unit size) right before and right after training it, and predicts with the mean of the two, so that the
    prediction brackets its measurement in time on a machine whose speed drifts within seconds. The table gives
    each side's median over rounds and the median of the per-round ratios."""
    rows = ["| model | schedule | D | W | B | N | partition | predicted s (median) | measured s (median) | "
            "median of per-round measured / predicted | per-round ratios |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    comm = measure_comm_local(2)
    for name in ("bert-tiny", "gpt2-tiny"):
        chain = build_model(name, seq_len=64)
        base = TrainConfig.from_flags(model=name, seq_len=64, corpus="synthetic", optimizer="adamw", steps=steps,
                                      threads=1, clip_grad=0.0)
        prof = profile_chain(chain, [2, 4, 8], reps=reps, warmup=2, threads=1, comm=comm, concurrent=2)
        chosen = [(e, base.with_flags(**plan_flags(e))) for e in
                  plan(prof, 2, global_batch=32, optimizer="adamw", top=4).ranked[:4]]
        pred: dict[int, list[float]] = {}
        meas: dict[int, list[float]] = {}
        for r in range(rounds):
            for k, (_, cfg) in enumerate(chosen):
                job = compile_job(cfg)
                before = predicted_step(chain, job, reps, comm)
                meas.setdefault(k, []).append(measured_step(cfg))
                pred.setdefault(k, []).append((before + predicted_step(chain, job, reps, comm)) / 2)
                print(f"  round {r} {name} #{k}: predicted {pred[k][-1]:.4f} measured {meas[k][-1]:.4f}", flush=True)
        for k, (e, cfg) in enumerate(chosen):
            c, p, m = e.candidate, statistics.median(pred[k]), statistics.median(meas[k])
            ratios = [b / a for a, b in zip(pred[k], meas[k])]
            per = ", ".join(f"{x:.2f}" for x in ratios)
            rows.append(f"| {name} | {c.label} | {c.stages} | {c.data_parallel} | {c.micro_batch_size} | "
                        f"{c.micro_batches} | {cfg.schedule.partition} | {p:.4f} | {m:.4f} | "
                        f"{statistics.median(ratios):.3f} | {per} |")
            print(rows[-1], flush=True)
    return rows


def _sleepy(seconds: float) -> nn.Module:
    class Sleep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(seconds)
            return self.lin(x)

    return Sleep()


def heavy(steps: int, reps: int) -> list[str]:
    def data(step: int, mb: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 100 + mb * 10 + rank)
        return torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)

    chain = LayerChain([lambda i=i: _sleepy(0.05 if i == 2 else 0.01) for i in range(8)], nn.functional.mse_loss,
                       data(0, 0, 0), name="heavy-layer")
    prof = profile_chain(chain, [2], reps=reps, warmup=1, threads=1, concurrent=2)
    sched = build_schedule("1f1b", 2, 8)
    planned = plan_partition(prof, sched, 2, False, "sgd")
    uniform = [4, 4]
    predicted_uniform = float(simulate(lower(sched), simulator_costs(prof, layers_of(uniform), 2, False, sched)
                                       ).makespan)
    base = TrainConfig.from_flags(model="heavy-layer", schedule="1f1b", stages=2, micro_batches=8, micro_batch_size=2, steps=steps,
                                  optimizer="sgd", clip_grad=0.0, threads=1)

    def run(sizes: list[int]) -> float:
        job = compile_job(base.with_flags(partition=",".join(map(str, sizes))), chain, data)
        return statistics.median(m["step_time_s"] for m in run_local(job).metrics[2:])

    m_uniform, m_planned = run(compile_job(uniform)), run(compile_job(planned.sizes))
    pred_margin = 1 - planned.step_s / predicted_uniform
    meas_margin = 1 - m_planned / m_uniform
    ok = "ok" if meas_margin >= pred_margin - 0.10 else "MISSED"
    return ["| partition | predicted s | measured s |", "|---|---|---|",
            f"| uniform {uniform} | {predicted_uniform:.4f} | {m_uniform:.4f} |",
            f"| planned {planned.sizes} | {planned.step_s:.4f} | {m_planned:.4f} |",
            f"\nmargin of the planned partition: predicted {pred_margin:.3f}, measured {meas_margin:.3f} "
            f"(goal: measured >= predicted - 0.10): {ok}"]


def breakdown(steps: int, reps: int) -> list[str]:
    from collections import defaultdict

    from chimera.timeline.events import events_from_simulation

    chain = build_model("bert-tiny", seq_len=64)
    prof = profile_chain(chain, [2, 4, 8], reps=reps, warmup=2, threads=1, comm=measure_comm_local(2), concurrent=2)
    best = plan(prof, 2, global_batch=32, optimizer="adamw", top=1).ranked[0]
    cfg = TrainConfig.from_flags(model="bert-tiny", seq_len=64, corpus="synthetic", optimizer="adamw", steps=steps,
                                 threads=1, clip_grad=0.0, profile=True, **plan_flags(best))
    job = compile_job(cfg)
    sim = simulated(prof, job)
    measured: dict[tuple[int, str], float] = defaultdict(float)
    for e in run_local(job).events:
        if e.iteration >= 2:
            measured[(e.worker % job.schedule.workers, e.kind)] += e.duration / ((steps - 2) * job.layout.data_parallel)
    predicted: dict[tuple[int, str], float] = defaultdict(float)
    for e in events_from_simulation(sim):
        predicted[(e.worker, e.kind)] += e.duration
    rows = [f"{best.candidate.label}, D = {best.candidate.stages}, B = {best.candidate.micro_batch_size}, "
            f"N = {best.candidate.micro_batches}, partition {plan_flags(best).get('partition')}: seconds per step",
            "", "| worker | kind | predicted s | measured s | measured / predicted |", "|---|---|---|---|---|"]
    for key in sorted(set(measured) | set(predicted)):
        p, m = predicted.get(key, 0.0), measured.get(key, 0.0)
        rows.append(f"| {key[0]} | {key[1]} | {p:.4f} | {m:.4f} | {m / p if p else float('nan'):.2f} |")
    return rows


def default_job(steps: int) -> list[str]:
    from chimera.timeline.analysis import step_stats
    from ray_launch.driver import RayJob

    rows = ["| partition | layers per stage | measured step s | measured utilization | predicted step s | "
            "simulated utilization |", "|---|---|---|---|---|---|"]
    for partition in ("planned", "uniform"):  # planned first: it takes the profile both predictions use
        cfg = TrainConfig.from_flags(partition=partition, steps=steps, profile=True)
        job = compile_job(cfg)
        with RayJob(job, log=lambda m: None) as rj:
            records = [rj.step(s) for s in range(steps)]
        events = [e for rec in records[1:] for r in rec["_results"] for e in r.events]
        stats = step_stats(events)
        measured = statistics.median(s.makespan for s in stats)
        util = 1 - statistics.median(s.bubble for s in stats)
        pred = job.prediction or _predicted(job)
        rows.append(f"| {partition} | {[len(x) for x in job.stage_layers]} | {measured:.4f} | {util:.3f} | "
                    f"{pred.step_s:.4f} | {1 - (pred.bubble or float('nan')):.3f} |")
        print(rows[-1], flush=True)
    return rows


def _predicted(job: Any) -> Prediction:
    """The simulator's step and bubble for a job's own partition, from the profile the planned run took."""
    world = job.world_size
    prof = cached_profile(job.chain, [job.unit_size], "cpu", job.run.threads, sharing(world, "cpu"))
    sim = simulated(prof, job)
    return Prediction(float(sim.makespan), "simulated", float(sim.bubble))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="accuracy,heavy,breakdown,default")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="accuracy: interleaved profile + measure rounds")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if "accuracy" in parts:
        print("\n".join(["## predicted vs measured (run_local, 2 workers, 1 thread each)", *accuracy(args.steps, args.reps,
                                                                                                 args.rounds)]))
    if "heavy" in parts:
        print("\n".join(["## one heavy layer: planned vs uniform partition", *heavy(args.steps, args.reps)]))
    if "breakdown" in parts:
        print("\n".join(["## where the time goes: predicted vs measured per action kind", *breakdown(args.steps,
                                                                                                   args.reps)]))
    if "default" in parts:
        print("\n".join(["## the default job: uniform vs planned partition (Ray)", *default_job(args.steps)]))


if __name__ == "__main__":
    main()

"""Training on Ray that survives lost workers: restart the whole group from the last checkpoint.

When a worker actor dies (its process killed, its node lost), its peers' waits fail and the driver, which
checks the step's results every second, sees the actor's death (``WorkerLost``). It then tears the job down
(every actor killed, the placement group removed: no actor or process group is left), reserves a new placement
group on the nodes alive now, starts fresh actors that restore the last complete checkpoint and continues, up to
``--max-restarts`` times. The metrics file gets one ``{"event": "restart", ...}`` line per restart (the error,
the step that failed, the step resumed from and how many steps are run again); re-run steps are marked
``"rerun": true``.

Ray's own actor restarts (``max_restarts``) do not fit: a restarted actor cannot rejoin the torch process
group of the others, so the group is restarted as a whole, as Ray Train does for its worker groups.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from chimera.job import Job
from chimera.runtime.checkpoint import CheckpointError, resume_point
from chimera.timeline import Event
from chimera.timeline.report import write_profile
from ray_launch.config import LaunchConfig
from ray_launch.driver import RayJob, WorkerLost, connect


@contextlib.contextmanager
def _metrics(out: str | Path | None) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A writer of JSONL records to ``out`` (a no-op without it)."""
    if not out:
        yield lambda rec: None
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        def write(rec: dict[str, Any]) -> None:
            f.write(json.dumps(rec) + "\n")
            f.flush()

        yield write


def train(job: Job, launch: LaunchConfig | None = None, *, out: str | Path | None = None,
          progress: bool = True) -> list[dict[str, Any]]:
    """Train ``job`` on Ray, restarting from the last checkpoint after a lost worker (module docstring); return
    one record per step."""
    launch = (launch or LaunchConfig()).check()
    log = (lambda msg: print(msg, file=sys.stderr)) if progress else (lambda msg: None)
    quiet = None if progress else (lambda msg: None)
    records: dict[int, dict[str, Any]] = {}
    restarts = 0
    attempt = RayJob(job, launch, log=quiet)  # refuses what the launch cannot do before Ray starts
    started = connect(launch, job.world_size)  # one Ray for every attempt
    try:
        with _metrics(out) as write:
            while True:
                try:
                    _attempt(attempt, records, write, progress)
                    break
                except WorkerLost as e:
                    if restarts >= job.cfg.training.max_restarts:
                        raise
                    restarts += 1
                    job, event = _restart(job, e, restarts, max(records, default=job.first_step - 1) + 1)
                    attempt = RayJob(job, launch, log=quiet)
                    write(event)
                    log(f"restart {restarts}/{job.cfg.training.max_restarts}: {event['error']}; resuming from step "
                        f"{event['resumed_from_step']} ({event['steps_rerun']} step(s) run again)")
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    return [records[s] for s in sorted(records)]


def _restart(job: Job, error: Exception, n: int, failed_at: int) -> tuple[Job, dict[str, Any]]:
    """The job resumed from the last complete checkpoint (the run's own start when none was written yet)."""
    t = job.cfg.training
    point = job.resume
    if t.checkpoint_dir is not None:
        with contextlib.suppress(CheckpointError):
            point = resume_point(job, t.checkpoint_dir)
    start = point.step if point is not None else 0
    event = {"event": "restart", "restart": n, "error": str(error).splitlines()[0], "failed_at_step": failed_at,
             "resumed_from_step": start, "steps_rerun": max(0, failed_at - start)}
    return replace(job, resume=point), event


def _attempt(ray_job: RayJob, records: dict[int, dict[str, Any]], write: Callable[[dict[str, Any]], None],
             progress: bool) -> None:
    """One run of the job's remaining steps on fresh actors; records and writes every step."""
    job = ray_job.job
    cfg = job.cfg
    steps = range(job.first_step, cfg.training.steps)
    events: list[Event] = []
    with ray_job:
        bar = tqdm(ray_job.steps(steps), total=len(steps), desc=cfg.run_name, disable=not progress, unit="step",
                   dynamic_ncols=True)
        for rec in bar:
            for r in rec.pop("_results"):
                off = ray_job.clock_offsets[r.rank] if ray_job.clock_offsets else 0.0
                events += [replace(e, start=e.start - off, end=e.end - off) for e in r.events]
            if rec["step"] in records:
                rec["rerun"] = True
            records[rec["step"]] = rec
            bar.set_postfix(loss=f"{rec['loss']:.4f}", samples_s=f"{rec['samples_per_s']:.1f}")
            write(rec)
        if cfg.profiling.profile:
            s, device = cfg.schedule, cfg.training.device
            last = records[max(records)] if records else {}
            meta = {"model": cfg.model.name, "schedule": s.name, "stages": s.stages, "mode": s.mode,
                    "micro_batches": s.micro_batches, "micro_batch_size": s.micro_batch_size,
                    "data_parallel": s.data_parallel, "device": device, "comm_payload": cfg.profiling.comm_payload,
                    "training_result": cfg.is_training_result, "profile_steps": sorted({e.iteration for e in events}),
                    "clock_offsets_s": ray_job.clock_offsets, "clock_uncertainty_s": ray_job.clock_uncertainty,
                    "clock": "CUDA events" if device == "cuda" else "CLOCK_MONOTONIC",
                    **({"offload": cfg.training.offload, "swap_bytes_per_step": last["swap_bytes"]}
                       if "swap_bytes" in last else {})}
            paths = write_profile(cfg.run_name, events, job.schedule, job.world_size, meta, ray_job.profile_dir)
            if progress:
                print("profile: " + " ".join(str(p) for p in paths.values()))

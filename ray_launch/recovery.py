"""Training on Ray that survives lost workers: restart the whole group from the last checkpoint.

    records = run(job, LaunchConfig(max_restarts=2), out="runs/x/metrics.jsonl")

When a worker actor dies (its process killed, its node lost), its peers' waits fail and the driver, which
checks the step's results every second, sees the actor's death (``WorkerLost``). It then tears the job down
(every actor killed, the placement group removed: no actor or process group is left), reserves a new placement
group on the nodes alive now, starts fresh actors that restore the last complete checkpoint and continues, up to
``--max-restarts`` times. Each restart prints a line (the worker and error, the step that failed, the step resumed
from, the steps run again) and the metrics file gets one ``{"event": "restart", ...}`` line; re-run steps are
marked ``"rerun": true``. The metrics file is appended to, never replaced: a resumed run adds
``{"event": "resume", ...}`` and its steps after the earlier run's lines.

Ray's own actor restarts (``max_restarts``) do not fit: a restarted actor cannot rejoin the torch process
group of the others, so the group is restarted as a whole, as Ray Train does for its worker groups.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from chimera.checkpoint import CheckpointError, resume_point
from chimera.job import Job
from chimera.timeline import Event
from chimera.timeline.report import write_profile
from ray_launch.config import LaunchConfig
from ray_launch.driver import RayJob, WorkerLost, connect


@dataclass
class RunReport:
    """What a run did: every step's record, the restarts, the steps run again."""

    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    rerun: int = 0
    profile_paths: dict[str, Path] = field(default_factory=dict)

    @property
    def steps_run(self) -> int:
        """Steps executed, re-runs included."""
        return len(self.records) + self.rerun


@contextlib.contextmanager
def _metrics(out: str | Path | None) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A writer of JSONL records appended to ``out`` (a no-op without it)."""
    if not out:
        yield lambda rec: None
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        def write(rec: dict[str, Any]) -> None:
            f.write(json.dumps(rec) + "\n")
            f.flush()

        yield write


def run(job: Job, launch: LaunchConfig | None = None, *, out: str | Path | None = None, progress: bool = True,
        report: RunReport | None = None, profile_dir: str | Path | None = None,
        say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Train ``job`` on Ray, restarting from the last checkpoint after a lost worker (module docstring); return
    one record per step. ``report``: filled with what the run did; ``say``: where the restart and checkpoint
    lines go (default: stderr, also without ``progress``)."""
    launch = (launch or LaunchConfig()).check()
    say = say or (lambda msg: print(msg, file=sys.stderr))
    quiet = None if progress else (lambda msg: None)
    report = report if report is not None else RunReport()
    attempt = RayJob(job, launch, log=quiet, out_dir=profile_dir)  # refuses what the launch cannot do first
    started = connect(launch, job.world_size)  # one Ray for every attempt
    try:
        with _metrics(out) as write:
            if job.resume is not None:
                write({"event": "resume", "from_step": job.resume.step, "checkpoint": job.resume.path})
            while True:
                try:
                    _attempt(attempt, report, write, progress, say)
                    break
                except WorkerLost as e:
                    if len(report.restarts) >= launch.max_restarts:
                        raise
                    failed_at = max(report.records, default=job.first_step - 1) + 1
                    job, event = _restart(job, e, len(report.restarts) + 1, failed_at)
                    report.restarts.append(event)
                    attempt = RayJob(job, launch, log=quiet, out_dir=profile_dir)
                    write(event)
                    say(f"restart {event['restart']}/{launch.max_restarts}: {event['error']}; step "
                        f"{event['failed_at_step']} failed; resuming from step {event['resumed_from_step']} "
                        f"({event['checkpoint'] or 'the start'}); {event['steps_rerun']} step(s) run again")
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    return [report.records[s] for s in sorted(report.records)]


def _restart(job: Job, error: Exception, n: int, failed_at: int) -> tuple[Job, dict[str, Any]]:
    """The job resumed from the last complete checkpoint (the run's own start when none was written yet)."""
    point = job.resume
    if job.checkpoint.dir is not None:
        with contextlib.suppress(CheckpointError):
            point = resume_point(job, job.checkpoint.dir)
    start = point.step if point is not None else 0
    event = {"event": "restart", "restart": n, "error": str(error).splitlines()[0], "failed_at_step": failed_at,
             "resumed_from_step": start, "steps_rerun": max(0, failed_at - start),
             "checkpoint": point.path if point is not None else None}
    return replace(job, resume=point), event


def _attempt(ray_job: RayJob, report: RunReport, write: Callable[[dict[str, Any]], None], progress: bool,
             say: Callable[[str], None]) -> None:
    """One run of the job's remaining steps on fresh actors; records and writes every step."""
    job = ray_job.job
    steps = range(job.first_step, job.run.steps)
    events: list[Event] = []
    with ray_job:
        bar = tqdm(ray_job.steps(steps), total=len(steps), desc=job.name, disable=not progress, unit="step",
                   dynamic_ncols=True)
        for rec in bar:
            for r in rec.pop("_results"):
                off = ray_job.clock_offsets[r.rank] if ray_job.clock_offsets else 0.0
                events += [replace(e, start=e.start - off, end=e.end - off) for e in r.events]
            if rec["step"] in report.records:
                rec["rerun"] = True
                report.rerun += 1
            report.records[rec["step"]] = rec
            bar.set_postfix(loss=f"{rec['loss']:.4f}", samples_s=f"{rec['samples_per_s']:.1f}")
            write(rec)
            if rec.get("checkpoint"):
                (bar.write if progress else say)(f"checkpoint: {rec['checkpoint']} (step {rec['step']} done)")
        if job.timeline.profile:
            report.profile_paths = _write_timeline(ray_job, report, events)


def _write_timeline(ray_job: RayJob, report: RunReport, events: list[Event]) -> dict[str, Path]:
    job = ray_job.job
    lay = job.layout
    last = report.records[max(report.records)] if report.records else {}
    meta = {"model": job.model, "schedule": lay.schedule, "stages": lay.stages, "mode": lay.mode,
            "micro_batches": lay.micro_batches, "micro_batch_size": lay.micro_batch_size,
            "data_parallel": lay.data_parallel, "device": job.run.device, "comm_payload": job.run.comm_payload,
            "training_result": job.run.is_training_result, "profile_steps": sorted({e.iteration for e in events}),
            "clock_offsets_s": ray_job.clock_offsets, "clock_uncertainty_s": ray_job.clock_uncertainty,
            "clock": "CUDA events" if job.run.device == "cuda" else "CLOCK_MONOTONIC",
            **({"predicted_step_s": job.prediction.step_s, "prediction": job.prediction.source}
               if job.prediction else {}),
            **({"offload": job.offload.text, "swap_bytes_per_step": last["swap_bytes"]}
               if "swap_bytes" in last else {})}
    return write_profile(job.name, events, job.schedule, job.world_size, meta, ray_job.profile_dir)

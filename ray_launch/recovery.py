"""Training on Ray that survives lost workers and nodes, and stops cleanly on SIGTERM.

    records = run(job, LaunchConfig(max_restarts=2), out="runs/x/metrics.jsonl")

When a worker actor dies (its process killed, its node lost), its peers' waits fail and the driver, which
checks the step's results every second, sees the actor's death (``WorkerLost``); a worker that stops answering
is lost once Ray declares its node dead (``RayJob.lost_workers``). The driver then tears the job down (every actor
killed, the placement group removed: no actor or process group is left), reserves a new placement group on the
nodes alive now, starts fresh actors that restore the last complete checkpoint and continues, up to
``--max-restarts`` times. When the nodes left have fewer worker slots than the job has workers, the job is
compiled again on fewer stages (``refit``; the checkpoint is keyed by layer, so it restores onto any split): the
same training, its sums in another order. Each restart logs a line (the worker and error, the step that failed,
the step resumed from, the steps run again) and the metrics file gets one ``{"event": "restart", ...}`` line;
re-run steps are marked ``"rerun": true``. The metrics file is appended to, never replaced: a resumed run adds
``{"event": "resume", ...}`` and its steps after the earlier run's lines; a run stopped by SIGTERM
(:mod:`ray_launch.preemption`) ends with ``{"event": "stopped", ...}`` naming its final checkpoint.

Ray's own actor restarts (``max_restarts``) do not fit: a restarted actor cannot rejoin the torch process
group of the others, so the group is restarted as a whole, as Ray Train does for its worker groups.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

from chimera.checkpoint import CheckpointError, resume_point
from chimera.compile import default_run_dir
from chimera.config import ConfigError
from chimera.job import Job, ResumePoint
from chimera.timeline import Event
from chimera.timeline.report import write_profile
from chimera.timeline.tensorboard import TensorBoardWriter
from ray_launch.cluster import connect
from ray_launch.config import LaunchConfig
from ray_launch.driver import RayJob, RunError, WorkerLost
from ray_launch.placement import capacity
from ray_launch.preemption import Preemption

logger = logging.getLogger(__name__)

#: (stages, checkpoint to resume from or None) -> the same request compiled on that many stages; raises
#: ConfigError when it does not compile so
Refit = Callable[[int, "str | None"], Job]


@dataclass
class RunReport:
    """What a run did: every step's record, the restarts, the steps run again, and where SIGTERM stopped it."""

    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    rerun: int = 0
    profile_paths: dict[str, Path] = field(default_factory=dict)
    stopped: dict[str, Any] | None = None  # the "stopped" event: steps done and the final checkpoint

    @property
    def steps_run(self) -> int:
        """Steps executed, re-runs included."""
        return len(self.records) + self.rerun


@contextlib.contextmanager
def _metrics(out: str | Path | None, board: str | Path | None) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A writer of records: JSONL lines appended to ``out``, and TensorBoard scalars under ``board`` (either, both or
    none)."""
    tb = TensorBoardWriter(board) if board else None
    f = None
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        f = open(out, "a")  # noqa: SIM115 - closed below
    try:
        def write(rec: dict[str, Any]) -> None:
            if f is not None:
                f.write(json.dumps(rec) + "\n")
                f.flush()
            if tb is not None:
                tb.write(rec)

        yield write
    finally:
        if f is not None:
            f.close()
        if tb is not None:
            tb.close()


def run(job: Job, launch: LaunchConfig | None = None, *, out: str | Path | None = None, progress: bool = True,
        report: RunReport | None = None, profile_dir: str | Path | None = None,
        say: Callable[[str], None] | None = None, tensorboard_dir: str | Path | None = None,
        stop: Preemption | None = None, refit: Refit | None = None) -> list[dict[str, Any]]:
    """Train ``job`` on Ray, restarting from the last checkpoint after a lost worker (module docstring); return
    one record per step. ``report``: filled with what the run did; ``say``: where the restart and checkpoint
    lines go (default: logging); ``tensorboard_dir``: where the TensorBoard scalars go with ``--tensorboard``
    (default: beside ``out``, else ``runs/NAME-TIME/tensorboard``); ``stop``: SIGTERM handling, installed once Ray
    is up; ``refit``: the job on fewer stages, for a restart whose nodes cannot host all workers."""
    launch = (launch or LaunchConfig()).check()
    quiet = None if progress else (lambda msg: None)
    report = report if report is not None else RunReport()
    if job.timeline.tensorboard and tensorboard_dir is None:
        tensorboard_dir = (Path(out).parent if out else default_run_dir(job.name)) / "tensorboard"
    attempt = RayJob(job, launch, log=quiet, out_dir=profile_dir)  # refuses what the launch cannot do first
    started = connect(launch, job.world_size)  # one Ray for every attempt
    if stop is not None:
        stop.install()  # after ray.init, which sets a SIGTERM handler of its own
    try:
        with _metrics(out, tensorboard_dir if job.timeline.tensorboard else None) as write:
            if job.resume is not None:
                write({"event": "resume", "from_step": job.resume.step, "checkpoint": job.resume.path})
            while True:
                try:
                    _attempt(attempt, report, write, progress, say or logger.info, stop)
                    break
                except WorkerLost as e:
                    if len(report.restarts) >= launch.max_restarts or (stop is not None and stop.requested):
                        raise
                    failed_at = max(report.records, default=job.first_step - 1) + 1
                    job, event = _restart(job, e, len(report.restarts) + 1, failed_at, refit)
                    report.restarts.append(event)
                    attempt = RayJob(job, launch, log=quiet, out_dir=profile_dir)
                    write(event)
                    (say or logger.warning)(
                        f"restart {event['restart']}/{launch.max_restarts}: {event['error']}; step "
                        f"{event['failed_at_step']} failed; resuming from step {event['resumed_from_step']} "
                        f"({event['checkpoint'] or 'the start'}); {event['steps_rerun']} step(s) run again"
                        + (f"; {event['refit']}" if "refit" in event else ""))
    finally:
        if stop is not None:
            stop.restore()
        if started and ray.is_initialized():
            ray.shutdown()
    return [report.records[s] for s in sorted(report.records)]


def _restart(job: Job, error: Exception, n: int, failed_at: int, refit: Refit | None) -> tuple[Job, dict[str, Any]]:
    """The job resumed from the last complete checkpoint (the run's own start when none was written yet), on fewer
    stages when the nodes alive cannot host all its workers."""
    point = job.resume
    if job.checkpoint.dir is not None:
        with contextlib.suppress(CheckpointError):
            point = resume_point(job, job.checkpoint.dir)
    start = point.step if point is not None else 0
    event = {"event": "restart", "restart": n, "error": str(error).splitlines()[0], "failed_at_step": failed_at,
             "resumed_from_step": start, "steps_rerun": max(0, failed_at - start),
             "checkpoint": point.path if point is not None else None}
    slots = capacity("GPU" if job.run.device == "cuda" else "CPU")
    if slots >= job.world_size:
        return replace(job, resume=point), event
    smaller = _fewer_stages(job, slots, point, refit)
    lay = smaller.layout
    event["refit"] = (f"the nodes left have {slots} worker slots for {job.world_size} workers: re-partitioned onto "
                      f"{lay.stages} stages x {lay.data_parallel} (layers per stage "
                      f"{','.join(str(len(x)) for x in smaller.stage_layers)})")
    event["stages"] = lay.stages
    return smaller, event


def _fewer_stages(job: Job, slots: int, point: ResumePoint | None, refit: Refit | None) -> Job:
    """The most stages below the job's that fit ``slots`` workers and compile (the same W, N and B: the same
    training), resuming from ``point``."""
    width = job.layout.data_parallel
    if refit is None:
        raise RunError(f"the nodes left have {slots} worker slots and the job needs {job.world_size}; add nodes, or "
                       "run from `chimera train`, which re-partitions onto fewer stages")
    why = []
    for stages in range(min(job.layout.stages - 1, slots // width), 0, -1):
        try:
            return refit(stages, point.path if point is not None else None)
        except ConfigError as e:
            why.append(f"{stages} stages: {str(e).splitlines()[0]}")
    raise RunError(f"the nodes left have {slots} worker slots and the job needs {job.world_size}; no fewer stages "
                   f"fit ({'; '.join(why) or f'--data-parallel {width} alone needs more'}): add nodes")


def _attempt(ray_job: RayJob, report: RunReport, write: Callable[[dict[str, Any]], None], progress: bool,
             say: Callable[[str], None], stop: Preemption | None) -> None:
    """One run of the job's remaining steps on fresh actors; records and writes every step. Once SIGTERM came
    (``stop``), the steps queued finish and a checkpoint of the state after the last is written."""
    job = ray_job.job
    steps = range(job.first_step, job.run.steps)
    events: list[Event] = []
    last = None
    with ray_job:
        stopped = (lambda: stop.requested) if stop is not None else None
        bar = tqdm(ray_job.steps(steps, stop=stopped), total=len(steps), desc=job.name, disable=not progress,
                   unit="step", dynamic_ncols=True)
        for rec in bar:
            for r in rec.pop("_results"):
                off = ray_job.clock_offsets[r.rank] if ray_job.clock_offsets else 0.0
                events += [replace(e, start=e.start - off, end=e.end - off) for e in r.events]
            if rec["step"] in report.records:
                rec["rerun"] = True
                report.rerun += 1
            report.records[rec["step"]] = rec
            last = rec["step"]
            bar.set_postfix(loss=f"{rec['loss']:.4f}", samples_s=f"{rec['samples_per_s']:.1f}")
            write(rec)
            if rec.get("checkpoint"):
                (bar.write if progress else say)(f"checkpoint: {rec['checkpoint']} (step {rec['step']} done)")
        bar.close()
        if stop is not None and stop.requested and (last is None or last < job.run.steps - 1):
            report.stopped = _final_checkpoint(ray_job, last)
            write(report.stopped)
        if job.timeline.profile:
            report.profile_paths = _write_timeline(ray_job, report, events)


def _final_checkpoint(ray_job: RayJob, last: int | None) -> dict[str, Any]:
    """The ``stopped`` event after a SIGTERM: the state after step ``last`` written as a checkpoint (none ran in
    this attempt: the checkpoint it started from)."""
    job = ray_job.job
    if last is None:
        done, path = job.first_step, job.resume.path if job.resume is not None else None
    else:
        done, path = last + 1, ray_job.checkpoint(last)
    return {"event": "stopped", "signal": "SIGTERM", "steps_done": done, "checkpoint": path}

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

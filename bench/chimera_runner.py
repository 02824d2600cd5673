"""The chimera side of ``bench/vs_torch_pipelining.py``: one ``RayJob`` per schedule, kept alive per workload.

Step time: one step, then the timed steps run back to back in one call on each actor (queued while the first
runs); the driver-observed time between the first step's results and the last's, over the timed steps, is their
mean: from all workers done with the first step to all workers done with the last — as on the torch.pp side
(rank 0 between the barriers after the first step and after the last).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench.workloads import Workload
from chimera.compile import compile_job
from chimera.config import TrainConfig
from chimera.job import Job
from chimera.runtime.launch import LocalResult
from chimera.schedule.registry import get as schedule_spec
from ray_launch.config import LaunchConfig
from ray_launch.driver import RayJob


def chimera_config(w: Workload, schedule: str, steps: int, options: dict[str, Any] | None = None,
                   p2p: str = "auto") -> TrainConfig:
    """The chimera config for workload ``w`` (same model, split, B, N, optimizer and data as torch.pp).

    ``auto`` gets the delay model in 2·D blocks of tf/2 (the split torch.pp's two-stages-per-rank rows run), so
    that it can choose schedules of 2·D stages (BitPipe, interleaved) too; a D-stage choice holds two blocks per
    stage, the same work. ``options``: the schedule's build options as ``auto`` names them (``mode``,
    ``split_backward``, ``chunks``); a schedule of 2·D stages gets the 2·D blocks too."""
    options = {k: v for k, v in (options or {}).items() if k in ("mode", "split_backward", "chunks")}
    parts = 2 * w.stages if schedule == "auto" and w.is_delay else w.stages
    if schedule != "auto" and w.is_delay:
        parts = schedule_spec(schedule).parts(w.stages, options)
    return TrainConfig.from_flags(model=w.model, model_overrides=w.overrides(parts), partition=w.sizes(w.stages) or "uniform",
                       schedule=schedule, stages=w.stages, **options,
                       micro_batches=w.micro_batches, micro_batch_size=w.micro_batch_size, seq_len=w.seq_len,
                       steps=steps, optimizer=w.optimizer, lr=1e-3, weight_decay=0.01, clip_grad=0.0, threads=1,
                       seed=w.seed, timeout_s=120.0, corpus="synthetic", p2p=p2p)


def row_p2p(name: str) -> tuple[str, str]:
    """A chimera row's schedule and p2p transport: ``1f1b@gloo`` runs 1F1B with ``--p2p gloo`` (the transport's
    share of a row, side by side with the default's); without ``@``, the default (``auto``)."""
    base, _, p2p = name.partition("@")
    if p2p not in ("", "gloo"):
        raise SystemExit(f"--schedules {name}: after '@' only 'gloo' (chimera's messages through gloo), got {p2p!r}")
    return base, p2p or "auto"


def quiet_ray_job(job: Job) -> RayJob:
    """``job`` on the running Ray session, as every chimera row and the calibration start it (a loaded machine may
    take minutes to start the actors; the driver's own log left out of the benchmark's)."""
    return RayJob(job, LaunchConfig(connect_timeout_s=300.0), log=lambda msg: None)


def run_on_ray(job: Job) -> LocalResult:
    """Run ``job`` on the running Ray session as the rows run (one actor per worker, every step back to back in one
    call on each actor, as a row's timed steps run); its records and the events it recorded: the calibration's
    launcher (:meth:`bench.predict.Calibration.measure`)."""
    with quiet_ray_job(job) as ray_job:
        records = list(ray_job.steps(range(job.run.steps), ahead=0, per_call=job.run.steps))
    events = [e for rec in records for res in rec.pop("_results") for e in res.events]
    return LocalResult(records, events)


class ChimeraRow:
    """A running chimera job for one schedule of a workload; a context manager."""

    def __init__(self, w: Workload, schedule: str, steps: int, options: dict[str, Any] | None = None) -> None:
        base, p2p = row_p2p(schedule)
        self.job = quiet_ray_job(compile_job(chimera_config(w, base, steps, options, p2p)))
        self.worker_times: list[float] = []
        choice = next((d for d in self.job.job.decisions if d.startswith("auto: ")), None)  # "auto: <flags>: ..."
        self.label = choice.split(": ")[1] if choice else schedule

    def __enter__(self) -> ChimeraRow:
        self.job.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.job.__exit__(*exc)

    @property
    def pids(self) -> list[int]:
        return [int(i["pid"]) for i in self.job.infos]

    def steps(self, steps: list[int]) -> float:
        """Run ``steps[0]``, then ``steps[1:]`` back to back in one call per actor (queued while the first runs); return
        the driver-observed mean time per step of ``steps[1:]`` (the workers' own step times in ``worker_times``)."""
        if len(steps) < 2:
            raise ValueError(f"need one step and at least one timed step, got {steps}")
        first, rest = self.job.submit(steps[0]), self.job.submit(steps[1:])
        self.job.collect(steps[0], first)
        t0 = time.perf_counter()
        recs = self.job.collect(steps[1:], rest)
        dt = time.perf_counter() - t0
        assert isinstance(recs, list)
        self.worker_times.append(statistics.mean(float(r["step_time_s"]) for r in recs))
        return dt / len(recs)


def peak_rss_mib(pids: list[int]) -> float | None:
    """Largest peak resident set (VmHWM) among ``pids``, in MiB (Linux /proc); None if unreadable."""
    peaks = []
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) / 1024)
        except OSError:
            continue
    return max(peaks) if peaks else None

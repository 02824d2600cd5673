"""``chimera train``: compile the request into a Job, run it on Ray, say what it did.

    chimera train --model bert-mini --schedule chimera --stages 4 --micro-batches 8 --steps 10
    chimera train --config run.toml --lr 2e-4          # the file's sections, a flag overriding one field
    python scripts/prof_steps_ray.py                   # the same command, the default job

Every run gets a directory (``--run-dir``, default ``runs/NAME-TIME``) with its metrics (``metrics.jsonl``), its
resolved configuration (``config.toml``: ``--config`` of it trains the same job) and, with ``--profile``, its
timeline files; with ``--tensorboard``, TensorBoard scalars under ``tensorboard/``.

Exit codes: 0 done; 1 the run failed; 2 a configuration error; 75 stopped by SIGTERM with a final checkpoint (the
message says how to continue); 143 stopped at once (a second SIGTERM, the grace period spent, or SIGTERM without
``--checkpoint-dir``); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chimera.checkpoint import complete
from chimera.cli import LEVELS, configure_logging
from chimera.cli.options import (
    Parser,
    UsageError,
    add_config_args,
    add_section_args,
    config_from_args,
    deprecated_alias,
    section_from_args,
)
from chimera.compile import compile_job, resolved_config
from chimera.compile.names import choices
from chimera.config import ConfigError, dump, writable_path
from chimera.job import Job
from ray_launch.config import LaunchConfig
from ray_launch.driver import RunError
from ray_launch.preemption import Preemption, Terminated
from ray_launch.recovery import Refit, RunReport, run

logger = logging.getLogger("chimera.train")
PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM with a final checkpoint; run again with --resume
TERMINATED = 143  # 128 + SIGTERM: stopped at once

DESCRIPTION = ("Train a model with pipeline parallelism on Ray: one actor per worker. Every field can also be set "
               "in a TOML file given with --config (sections as the groups below; flags override the file).")


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The request's sections, the Ray layer's ``[launch]``, and where the run's outputs go."""
    add_config_args(p, names_of=choices)
    add_section_args(p, "launch", LaunchConfig)
    out = p.add_argument_group("[outputs]", "where the run writes")
    out.add_argument("--run-dir", default=None, help="the run's directory: metrics, config.toml, timeline files "
                     "(default: runs/NAME-TIME)")
    out.add_argument("--output", "-o", default=None, help="the metrics file, one JSON object per step, appended to "
                     "(default: RUN_DIR/metrics.jsonl)")
    deprecated_alias(out, "--out", "--output", "output")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--log-level", default="info", choices=LEVELS, help="what the run logs to stderr "
                     "(default: info)")
    out.add_argument("--dry-run", action="store_true", help="compile the job, print its decisions and resolved "
                     "configuration, and stop before starting Ray")


def add_parser(sub: Any, parser_class: type) -> None:
    """``chimera train``."""
    p = sub.add_parser("train", help="train on Ray", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(p)
    p.set_defaults(func=cmd_train)


def _outputs(ns: argparse.Namespace, job: Job) -> tuple[Path, Path, Path]:
    """(run directory, metrics file, config file): ``--run-dir``, else the folder of ``--output``, else a new
    ``runs/NAME-TIME``."""
    if ns.run_dir:
        run_dir = Path(ns.run_dir)
    elif ns.output:
        run_dir = Path(ns.output).parent
    else:
        run_dir = Path("runs") / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    metrics = Path(ns.output) if ns.output else run_dir / "metrics.jsonl"
    writable_path(str(metrics), "--output", directory=False)
    writable_path(str(run_dir), "--run-dir", directory=True)
    config = run_dir / "config.toml" if not ns.output else metrics.with_name(metrics.stem + ".config.toml")
    return run_dir, metrics, config


def _compile(ns: argparse.Namespace) -> tuple[Job, LaunchConfig, Any, Refit]:
    """The job, the launch options, the resolved request, and the request compiled on fewer stages (a restart onto
    the nodes left)."""
    cfg, parts = config_from_args(ns, {"launch": LaunchConfig})
    launch = section_from_args(ns, "launch", parts["launch"]).check()
    job = compile_job(cfg, log=logger.info)
    if launch.max_restarts and job.checkpoint.dir is None:
        raise ConfigError("--max-restarts restarts from the last checkpoint: add --checkpoint-dir DIR and "
                          "--checkpoint-every K")

    def refit(stages: int, resume: str | None) -> Job:
        flags: dict[str, Any] = {"stages": stages, "resume": resume}
        if "," in cfg.schedule.partition:  # layers per stage for the old depth
            flags["partition"] = "uniform"
        return compile_job(cfg.with_flags(**flags), log=logger.info)

    return job, launch, resolved_config(cfg, job), refit


def cmd_train(ns: argparse.Namespace) -> int:
    """Run from parsed flags; configuration errors: one line, exit code 2 (the module docstring lists the codes)."""
    configure_logging(ns.log_level)
    try:
        job, launch, resolved, refit = _compile(ns)
        run_dir, metrics, config = _outputs(ns, job)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in job.decisions:
        logger.info(line)
    text = dump(resolved, {"launch": launch})
    if ns.dry_run:
        print(text, end="")
        return 0
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(text)
    if job.resume is not None:
        logger.info(f"resume: from step {job.resume.step} of {job.resume.path}")
    stop = Preemption(launch.grace_period_s, can_save=job.checkpoint.dir is not None)
    stop.install()
    report = RunReport()
    try:
        records = run(job, launch, out=metrics, progress=not ns.no_progress, report=report,
                      profile_dir=run_dir if job.timeline.profile or job.timeline.nsys else None,
                      tensorboard_dir=run_dir / "tensorboard", stop=stop, refit=refit)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Terminated as e:
        print(f"stopped: {e}; {_last_checkpoint(job)}", file=sys.stderr)
        return TERMINATED
    except KeyboardInterrupt:
        print("interrupted: all actors stopped", file=sys.stderr)
        return 130
    finally:
        stop.restore()
    if report.stopped is not None:
        _stopped(job, report.stopped, ns, run_dir, metrics, config)
        return PREEMPTED
    _summary(job, records, report, metrics, config)
    return 0


def _last_checkpoint(job: Job) -> str:
    done = complete(job.checkpoint.dir) if job.checkpoint.dir and Path(job.checkpoint.dir).is_dir() else []
    return f"the last complete checkpoint: {done[-1]}" if done else "no checkpoint was written"


def _stopped(job: Job, event: dict[str, Any], ns: argparse.Namespace, run_dir: Path, metrics: Path,
             config: Path) -> None:
    """What SIGTERM left and the command that continues the run (the same metrics file)."""
    where = f"--output {metrics}" if ns.output else f"--run-dir {run_dir}"
    if event["checkpoint"] is None:
        print(f"{job.name}: stopped by SIGTERM before any step: no checkpoint; start again with: chimera train "
              f"--config {config}", file=sys.stderr)
        return
    print(f"{job.name}: stopped by SIGTERM with {event['steps_done']} of {job.run.steps} steps done; checkpoint "
          f"{event['checkpoint']}; continue with: chimera train --config {config} --resume {job.checkpoint.dir} "
          f"{where}", file=sys.stderr)


def _summary(job: Job, records: list[dict[str, Any]], report: RunReport, metrics: Path, config: Path) -> None:
    last = records[-1]
    note = "" if job.run.is_training_result else " [single-byte payload: NOT a training result]"
    again = (f" ({report.rerun} re-run after {len(report.restarts)} restart(s): {report.steps_run} run in all)"
             if report.restarts else "")
    print(f"{job.name}: {len(records)} steps{again}, final loss {last['loss']:.4f}, {last['samples_per_s']:.1f} "
          f"samples/s; metrics in {metrics}, configuration in {config}{note}")
    for path in report.profile_paths.values():
        print(f"profile: {path}")
    if job.prediction and len(records) > 1:
        # steps that record a timeline pay for it: left out where others remain
        timed = records[1:]
        if job.timeline.profile:
            timed = [r for r in timed if not job.timeline.records(r["step"])] or timed
        measured = statistics.median(r["step_time_s"] for r in timed)
        predicted = job.prediction.step_s
        which = (f"steps 1-{len(records) - 1}" if len(timed) == len(records) - 1 else
                 f"{len(timed)} steps after the first that recorded no timeline")
        print(f"step time: predicted {predicted:.4g} s ({job.prediction.source}), measured {measured:.4g} s "
              f"(median of {which}; measured / predicted = {measured / predicted:.2f})")
        if job.prediction.trust:
            print(f"  the plan's trust note: {job.prediction.trust}")


def train_main(argv: Sequence[str] | None = None, defaults: dict[str, Any] | None = None) -> int:
    """``chimera train`` without the subcommand word (``scripts/prof_steps_ray.py``); ``defaults`` replace the
    parser's defaults (a launcher script's own)."""
    p = Parser(prog="chimera train", description=DESCRIPTION)
    add_train_args(p)
    if defaults:
        p.set_defaults(**defaults)
    try:
        ns = p.parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return cmd_train(ns)

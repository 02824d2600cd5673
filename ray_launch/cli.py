"""The command line of a Ray run: training flags (``chimera.flags``) plus the launcher's (``ray_launch.config``).

``scripts/prof_steps_ray.py``, ``scripts/prof_steps_ray_multinode.py`` and ``chimera train`` call :func:`main`.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from chimera.config import ConfigError
from chimera.flags import add_train_args, config_from_args
from chimera.job import Job
from chimera.validation import writable_path
from ray_launch.config import LaunchConfig, add_launch_args, launch_from_args
from ray_launch.driver import RunError, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train a model with a Chimera / 1F1B / GPipe pipeline on Ray.")
    add_train_args(p)
    add_launch_args(p)
    p.add_argument("--out", default=None, help="JSONL metrics file (default: profiles/<run name>.metrics.jsonl)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _checked(ns: argparse.Namespace) -> tuple[Job, LaunchConfig]:
    """The job (with ``--plan`` applied: a plan file, or ``auto``, which profiles and plans first) and the launch."""
    cfg = config_from_args(ns)
    launch = launch_from_args(ns).check()
    if ns.plan:
        from chimera.plan import PlanError
        from chimera.plan.auto import apply_plan
        from chimera.profile import ProfileError

        try:
            cfg, chosen = apply_plan(cfg, ns.plan, cfg.preset_chain())
        except (PlanError, ProfileError) as e:
            raise ConfigError(f"--plan {ns.plan}: {e}") from None
        print(f"plan: {chosen.flags} (predicted {chosen.predicted_step_s:.4g} s/step)", file=sys.stderr)
        return replace(cfg.check(), prediction={"step_s": chosen.predicted_step_s, "profile": ns.plan}), launch
    job = cfg.check()
    if job.schedule_choice:  # --schedule auto: what it chose and why; --schedule-file: which file
        print(f"schedule: {job.schedule_choice}", file=sys.stderr)
    return job, launch


def run_from_args(ns: argparse.Namespace) -> int:
    """Run from parsed flags; configuration errors: one line, exit code 2."""
    try:
        job, launch = _checked(ns)
        out = ns.out or f"profiles/{job.cfg.run_name}.metrics.jsonl"
        writable_path(out, "--out", directory=False)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = job.cfg
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        records = run(job, launch, out=out, progress=not ns.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: all actors stopped", file=sys.stderr)
        return 130
    last = records[-1]
    note = "" if cfg.is_training_result else " [single-byte payload: NOT a training result]"
    print(f"{cfg.run_name}: {len(records)} steps, final loss {last['loss']:.4f}, "
          f"{last['samples_per_s']:.1f} samples/s; metrics in {out}{note}")
    if job.prediction and len(records) > 1:
        measured = statistics.median(r["step_time_s"] for r in records[1:])
        predicted = job.prediction["step_s"]
        print(f"step time: predicted {predicted:.4g} s ({job.prediction.get('profile')}), measured {measured:.4g} s "
              f"(median of steps 1-{len(records) - 1}; measured / predicted = {measured / predicted:.2f})")
    return 0


def main(argv: Sequence[str] | None = None, defaults: dict[str, Any] | None = None) -> int:
    parser = build_parser()
    if defaults:
        parser.set_defaults(**defaults)
    return run_from_args(parser.parse_args(argv))

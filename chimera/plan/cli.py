"""``chimera plan``: rank the configurations of a profiled model and write the best as a plan file.

    chimera plan --model bert-48 --profile profiles/bert-48.profile.json --workers 32 --memory-per-worker 16GiB \
        --global-batch 256 --top 10 -o profiles/bert-48.plan.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_plan_parser(sub: Any) -> None:
    """The ``plan`` subcommand."""
    p = sub.add_parser("plan", help="choose schedule, D, W, B, N, recomputation and partition from a profile")
    p.add_argument("--model", required=True, help="the model preset the profile was taken of")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (as profiled)")
    p.add_argument("--profile", required=True, help="profile file (chimera profile -o ...)")
    p.add_argument("--workers", "-K", type=int, required=True, help="workers (D x W) to plan for")
    p.add_argument("--stages", "-D", type=int, default=None, help="fix the pipeline depth D (default: search every D "
                   "dividing --workers)")
    p.add_argument("--memory-per-worker", default=None, help="memory limit per worker, e.g. 80GiB (default: the "
                   "profiled device's memory, or none)")
    p.add_argument("--global-batch", "-G", type=int, default=None, help="samples per step (N x B x W); default: the "
                   "largest profiled micro-batch per worker")
    p.add_argument("--optimizer", default="lamb", help="optimizer whose state counts in memory (lamb, adamw, sgd)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    p.add_argument("--json", action="store_true", help="print the ranked candidates as JSON")
    p.add_argument("-o", "--output", default=None, help="plan file (default: profiles/MODEL.plan.json)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    """Run the planner; print the table; write the plan file."""
    from chimera.cli import UsageError
    from chimera.models import build_model
    from chimera.optim import OPTIMIZERS
    from chimera.plan import Plan, PlanError, parse_bytes, plan
    from chimera.plan.planfile import summary
    from chimera.plan.report import report
    from chimera.profile import Profile, ProfileError

    if args.workers < 1 or args.top < 1 or (args.global_batch is not None and args.global_batch < 1):
        raise UsageError("--workers, --top and --global-batch must be >= 1")
    if args.optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {args.optimizer!r}")
    try:
        chain = build_model(args.model, seq_len=args.seq_len)
        profile = Profile.load(args.profile).check(chain)
        limit = parse_bytes(args.memory_per_worker) if args.memory_per_worker else profile.device_memory_bytes
        result = plan(profile, args.workers, args.global_batch, limit, args.optimizer, args.top, stages=args.stages)
        chosen = Plan.from_result(result, args.model, profile.fingerprint, profile.device)
    except (ValueError, ProfileError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([summary(e) for e in result.ranked[:args.top]]))
    else:
        print(report(result, args.top))
    out = chosen.save(args.output or f"profiles/{args.model}.plan.json")
    print(f"plan: {out} ({chosen.flags['schedule']}, D={chosen.flags['stages']}, W={chosen.flags['data_parallel']}, "
          f"predicted {chosen.predicted_step_s:.4g} s/step)", file=sys.stderr if args.json else sys.stdout)
    return 0

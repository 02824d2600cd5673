"""``chimera plan``: rank the configurations of a profiled model and write the best as a plan file.

    chimera plan --model bert-48 --profile-file profiles/bert-48.profile.json --workers 32 \
        --memory-per-worker 16GiB --global-batch 256 --top 10 -o profiles/bert-48.plan.json
    chimera plan --chain mypkg.models:chain --profile-file p.json --workers 4     # your own model
    chimera plan --model bert-48 --profile-file p.json --workers 32 --shard-optimizer   # ZeRO-1 priced and planned
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from chimera.cli.common import add_model_args, model_of
from chimera.cli.options import UsageError, add_field, deprecated_alias
from chimera.compile.names import choices
from chimera.compile.shard import owned_pricer
from chimera.config import FIELDS
from chimera.plan import PlanError, PlanFile, plan
from chimera.plan.period import PERIOD_BUDGET, STEADY_STEPS, affordable, by_period, steps_overlap
from chimera.plan.planfile import summary
from chimera.plan.profiles import trust_note
from chimera.plan.report import report
from chimera.profile import Profile, ProfileError
from chimera.util.units import parse_bytes


def add_parser(sub: Any, parser_class: type) -> None:
    """The ``plan`` subcommand."""
    p = sub.add_parser("plan", help="choose schedule, D, W, B, N, recomputation, offload and partition from a "
                                    "profile")
    add_model_args(p)
    # not required=True: argparse would then refuse the deprecated --profile spelling that sets the same dest
    p.add_argument("--profile-file", default=None, help="profile file (chimera profile -o ...) (required)")
    deprecated_alias(p, "--profile", "--profile-file", "profile_file")
    p.add_argument("--workers", "-K", type=int, required=True, help="workers (D x W) to plan for")
    p.add_argument("--nodes", type=int, default=1, help="machines the workers are spread over; on CPU the workers "
                   "of one machine share its cores, and the plan says whether the profile was taken that way "
                   "(chimera profile --concurrent) (default: 1, all on one machine)")
    add_field(p, "stages", default=None, help="fix the pipeline depth D (default: every D dividing --workers)")
    add_field(p, "memory_per_worker", default=None, help="memory limit per worker, e.g. 80GiB (default: the "
              "profiled device's memory, or none)")
    p.add_argument("--global-batch", "-G", type=int, default=None, help="samples per step (N x B x W) (default: the "
                   "largest profiled micro-batch per worker)")
    add_field(p, "optimizer", default="lamb", help="optimizer whose state counts in memory", names_of=choices)
    add_field(p, "clip_grad", default=FIELDS["clip_grad"].default, help="the --clip-grad training will use: above 0 "
              "every optimizer step is priced with clipping by the global gradient norm (its passes, its allreduce)")
    add_field(p, "post_validate", default=False, help="price the --post-validate training will use: each stage "
              "update's rollback copy of its weights and optimizer state counts in memory, and no candidate is "
              "offloaded")
    add_field(p, "shard_optimizer", default=False, help="price every candidate with its optimizer state sharded over "
              "each stage's replicas (ZeRO-1, as training's --shard-optimizer assigns it: a worker counts only the "
              "state it owns; no offload), and record the flag in the plan file so that --plan FILE trains sharded")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table (default: 10)")
    p.add_argument("--json", action="store_true", help="print the ranked candidates as JSON")
    p.add_argument("-o", "--output", default=None, help="plan file (default: profiles/MODEL.plan.json)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    """Run the planner; print the table; write the plan file."""
    if args.profile_file is None:
        raise UsageError("--profile-file is required: the profile to plan from (chimera profile -o FILE)")
    if args.workers < 1 or args.top < 1 or (args.global_batch is not None and args.global_batch < 1):
        raise UsageError("--workers, --top and --global-batch must be >= 1")
    if args.clip_grad < 0:
        raise UsageError(f"--clip-grad {args.clip_grad}: give 0 (no clipping) or the norm training clips to")
    if not 1 <= args.nodes <= args.workers:
        raise UsageError(f"--nodes {args.nodes}: need 1 <= --nodes <= --workers ({args.workers})")
    chain = model_of(args)
    try:
        profile = Profile.load(args.profile_file).check(chain)
        limit = parse_bytes(args.memory_per_worker) if args.memory_per_worker else profile.device_memory_bytes
        owned = owned_pricer(chain) if args.shard_optimizer else None
        result = plan(profile, args.workers, args.global_batch, limit, args.optimizer, args.top, stages=args.stages,
                      optimizer_owned=owned, clip=args.clip_grad > 0, post_validated=args.post_validate)
        overlap = steps_overlap(args.clip_grad > 0, args.post_validate)
        priced = overlap and affordable(result.ranked[:args.top])
        if priced:  # training overlaps its steps: what it measures is the steady state's period
            top = by_period(result.ranked[:args.top], profile, args.optimizer, args.clip_grad > 0,
                            args.post_validate)
            result = replace(result, ranked=top + result.ranked[args.top:])
        trust = trust_note(profile, args.workers, args.nodes)
        chosen = PlanFile.from_result(result, chain.name, profile.fingerprint, profile.device, trust=trust,
                                      tokens_per_sample=chain.tokens_per_sample(), clip_grad=args.clip_grad,
                                      post_validate=args.post_validate)
    except (ValueError, ProfileError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([summary(e) for e in result.ranked[:args.top]]))
    else:
        print(report(result, args.top))
        if priced:
            print(f"step s of the top {args.top}: the period of {STEADY_STEPS} overlapped steps (training overlaps "
                  "its steps: no --clip-grad, or --post-validate); the rest by one step")
        elif overlap:
            print(f"step s: one step's makespan, at least the period of the overlapped steps training runs (the top "
                  f"{args.top} are too large to simulate over {STEADY_STEPS} steps here: more than {PERIOD_BUDGET} "
                  "compute actions a step in all)")
    out = chosen.save(args.output or f"profiles/{chain.name}.plan.json")
    print(f"trust: {trust or _as_taken(profile)}", file=sys.stderr if args.json else sys.stdout)
    print(f"plan: {out} ({chosen.flags['schedule']}, D={chosen.flags['stages']}, W={chosen.flags['data_parallel']}, "
          f"predicted {chosen.predicted_step_s:.4g} s/step)", file=sys.stderr if args.json else sys.stdout)
    return 0


def _as_taken(profile: Profile) -> str:
    """The trust line of a profile taken as the workers will run."""
    return (f"profile taken as the workers will run ({profile.concurrent} process(es) at once, {profile.threads} "
            "thread(s) each)")

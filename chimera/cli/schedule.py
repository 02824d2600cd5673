"""``chimera schedule show|simulate|plot|best``: schedules as data, on the command line.

    chimera schedule show chimera --stages 4 --micro-batches 8 --format text
    chimera schedule simulate chimera -D 4 -N 4 --fwd 1 --bwd 2 --json
    chimera schedule best -D 8 -N 16 --fwd 1 --bwd 1 --wgrad 1 --memory-limit-units 16 --weight-memory-units 2
    chimera schedule best -D 8 -N 16 --fwd 1 --bwd 1 --wgrad 1 --rank-by period
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction
from typing import Any

from chimera.cli.options import UsageError, add_field, deprecated_alias
from chimera.offload.lowering import lower
from chimera.offload.policy import Offload
from chimera.schedule import (
    SCHEDULES,
    Costs,
    Schedule,
    ScheduleConfigError,
    build_schedule,
    simulate,
    to_csv,
    to_json,
    validate,
)
from chimera.schedule.best import RANK_BY, best, ranking, table


def number(text: str) -> Fraction | float:
    """An exact number where it is one (``1/3``, ``2``), else a float."""
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _add_shape(p: argparse.ArgumentParser) -> None:
    """D and N, required: the same flags as training's."""
    add_field(p, "stages", default=None, required=True, help="pipeline depth D (workers per pipeline)")
    add_field(p, "micro_batches", default=None, required=True, help="micro-batches per iteration N")


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help=f"schedule: {', '.join(SCHEDULES)}")
    _add_shape(p)
    for flat in ("chunks", "mode", "data_parallel"):
        add_field(p, flat, default=None)
    deprecated_alias(p, "-v", "--chunks", "chunks", type=int)
    p.add_argument("--reverse-backward", action="store_true", help="GPipe: backward in reverse order")
    add_field(p, "split_backward", default=False)
    p.add_argument("--lowered", action="store_true", help="include send/recv, allreduce and optimizer actions")
    add_field(p, "offload", default="none", help="lowered with the swaps of this offload policy (a level for all "
              "stages, or a comma list with one per stage; implies --lowered)")
    add_field(p, "prefetch", default=1)


def _schedule(args: argparse.Namespace, check: bool = True) -> Schedule:
    """The schedule the flags ask for; ``check``: validate it (a generator's schedule is valid by construction,
    and the simulator reports a deadlock itself, so simulate and plot skip it)."""
    chunks = 2 if args.chunks is None else args.chunks
    if chunks < 1:
        raise ScheduleConfigError(f"--chunks (v) must be >= 1, got {chunks}")
    s = build_schedule(args.name, args.stages, args.micro_batches, chunks=chunks, mode=args.mode or "direct",
                       data_parallel=args.data_parallel or 1, reverse_backward=args.reverse_backward,
                       split_backward=args.split_backward)
    if check:
        validate(s)
    if args.offload != "none":
        try:
            return lower(s, Offload.parse(args.offload, args.prefetch))
        except ValueError as e:
            raise ScheduleConfigError(f"--offload {args.offload} --prefetch {args.prefetch}: {e}") from None
    return lower(s) if args.lowered else s


def _costs(args: argparse.Namespace) -> Costs:
    return Costs(fwd=args.fwd, bwd=args.bwd, wgrad=args.wgrad, p2p_latency=args.p2p_latency,
                 allreduce=args.allreduce, optimizer=args.optimizer_time, swap_in=args.swap_in,
                 swap_out=args.swap_out)


def cmd_show(args: argparse.Namespace) -> int:
    s = _schedule(args)
    if args.format == "json":
        print(to_json(s))
    elif args.format == "csv":
        print(to_csv(s), end="")
    else:
        print(s.text())
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    s = _schedule(args, check=False)
    r = simulate(s, _costs(args))
    d = r.as_dict()
    if args.json:
        print(json.dumps(d))
        return 0
    print(f"{s.name}: D={s.stages} workers={s.workers} N={s.microbatches} W={s.data_parallel}")
    print(f"makespan          {d['makespan']}")
    print(f"bubble            {d['bubble']:.4f}  ({r.bubble})")
    print(f"busy              {' '.join(str(b) for b in d['busy'])}")
    print(f"peak activations  {' '.join(str(p) for p in d['peak_activations'])}")
    return 0


def cmd_best(args: argparse.Namespace) -> int:
    if args.stages < 1 or args.micro_batches < 1:
        raise UsageError("need --stages >= 1 and --micro-batches >= 1")
    if args.weight_memory_units < 0:
        raise UsageError(f"--weight-memory-units must be >= 0, got {args.weight_memory_units}")
    if not 0 <= args.sharded_memory_units <= args.weight_memory_units:
        raise UsageError(f"--sharded-memory-units must be between 0 and --weight-memory-units "
                         f"({args.weight_memory_units}), got {args.sharded_memory_units}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1 (1: one step, no period), got {args.steps}")
    if args.rank_by == "period" and args.steps < 2:
        raise UsageError("--rank-by period needs --steps >= 2")
    choice, ranked = best(args.stages, args.micro_batches, _costs(args), args.memory_limit_units,
                          halving=not args.no_halving, weight_memory=args.weight_memory_units, steps=args.steps,
                          by=args.rank_by, sharded_memory=args.sharded_memory_units)
    print(json.dumps(ranking(choice, ranked, args.rank_by)) if args.json else table(choice, ranked, args.rank_by))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from chimera.timeline.events import events_from_simulation  # matplotlib loads only for a plot
    from chimera.timeline.plot import plot_timeline, save_figure

    s = _schedule(args, check=False)
    r = simulate(s, _costs(args))
    title = (f"{s.name} D={s.stages} N={s.microbatches} (F={args.fwd}, B={args.bwd}, W={args.wgrad}): makespan "
             f"{float(r.makespan):g}, bubble {float(r.bubble):.1%}")
    fig = plot_timeline(events_from_simulation(r), s.workers, title=title, time_unit="units")
    for path in save_figure(fig, args.output):
        print(path)
    return 0


def _add_best_args(p: argparse.ArgumentParser) -> None:
    _add_shape(p)
    p.add_argument("--memory-limit-units", type=number, default=None,
                   help="most memory a worker may hold, in micro-batches of activations: its peak activations plus "
                        "--weight-memory-units per share of the model it holds (default: none)")
    deprecated_alias(p, "--memory-limit", "--memory-limit-units", "memory_limit_units", type=number)
    p.add_argument("--weight-memory-units", type=number, default=Fraction(0),
                   help="memory of one worker's share of the model (parameters, gradients, optimizer state) in "
                        "micro-batches of activations; a schedule holds 1 (1F1B) to 4 (chimera4) shares (default 0: "
                        "activations only)")
    deprecated_alias(p, "--weight-memory", "--weight-memory-units", "weight_memory_units", type=number)
    p.add_argument("--sharded-memory-units", type=number, default=Fraction(0),
                   help="of --weight-memory-units, the optimizer state that each stage's replicas shard among "
                        "themselves (training's --shard-optimizer: an extra replica then costs only weights and "
                        "gradients; e.g. AdamW in fp32: half of it) (default 0: not sharded)")
    p.add_argument("--steps", type=int, default=5,
                   help="consecutive training steps simulated per candidate for its steady-state period (each stage "
                        "updated as soon as its gradients are summed, the next step's start-up overlapping the "
                        "drain); 1: one step only, no period (default: 5)")
    p.add_argument("--rank-by", choices=RANK_BY, default="makespan",
                   help="rank by one step's makespan (what training's auto does) or by the period (default: makespan)")
    p.add_argument("--no-halving", action="store_true",
                   help="leave out Chimera's backward halving (odd micro-batch size, or a unit's cost that does not "
                        "shrink with its size)")


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fwd", type=number, default=Fraction(1), help="forward time per micro-batch (default: 1)")
    p.add_argument("--bwd", type=number, default=Fraction(2),
                   help="backward time per micro-batch (its input-gradient part when --wgrad is given) (default: 2)")
    p.add_argument("--wgrad", type=number, default=Fraction(0),
                   help="weight-gradient time per micro-batch (a W; a whole backward costs --bwd + --wgrad) "
                        "(default: 0)")
    p.add_argument("--p2p-latency", type=number, default=Fraction(0), help="time of one p2p message (default: 0)")
    p.add_argument("--allreduce", type=number, default=Fraction(0),
                   help="gradient allreduce time per stage (default: 0)")
    p.add_argument("--optimizer-time", type=number, default=Fraction(0), help="optimizer step time (default: 0)")
    deprecated_alias(p, "--optimizer", "--optimizer-time", "optimizer_time", type=number)
    p.add_argument("--swap-in", type=number, default=Fraction(0),
                   help="a stage's weights host -> device (default: 0)")
    p.add_argument("--swap-out", type=number, default=Fraction(0),
                   help="a stage's gradients device -> host (default: 0)")


def add_parser(sub: Any, parser_class: type) -> None:
    """The ``schedule`` subcommand and its actions."""
    sched = sub.add_parser("schedule", help="show, simulate, plot or rank pipeline schedules")
    ssub = sched.add_subparsers(dest="action", required=True, parser_class=parser_class)
    show = ssub.add_parser("show", help="print a schedule as text, CSV or JSON")
    _add_schedule_args(show)
    show.add_argument("--format", choices=("text", "csv", "json"), default="text", help="(default: text)")
    show.set_defaults(func=cmd_show)
    for name, func, helptext in (("simulate", cmd_simulate, "simulate one iteration"),
                                 ("plot", cmd_plot, "draw the simulated worker x time grid"),
                                 ("best", cmd_best, "simulate every schedule for D and N and pick the fastest")):
        p = ssub.add_parser(name, help=helptext)
        (_add_best_args if name == "best" else _add_schedule_args)(p)
        _add_cost_args(p)
        if name != "plot":
            p.add_argument("--json", action="store_true", help="print one JSON object")
        else:
            p.add_argument("-o", "--output", required=True, help="output file (.png/.pdf; no suffix: both)")
        p.set_defaults(func=func)

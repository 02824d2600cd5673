"""The ``chimera`` command line.

Examples::

    chimera schedule show chimera --stages 4 --micro-batches 8 --format text
    chimera schedule show 1f1b --stages 4 --micro-batches 8 --format json --lowered
    chimera schedule simulate chimera --stages 4 --micro-batches 4 --fwd 1 --bwd 2 --json
    chimera schedule plot chimera --stages 4 --micro-batches 8 -o chimera.png
    chimera schedule simulate chimera -D 2 -N 4 --offload everything --prefetch 1 --swap-in 1 --swap-out 1
    chimera schedule best -D 8 -N 16 --fwd 1 --bwd 1 --wgrad 1 --memory-limit 8
    chimera schedule best -D 8 -N 16 --fwd 1 --bwd 1 --wgrad 1 --memory-limit 16 --weight-memory 2
    chimera data prepare enwiki-latest-pages-articles.xml.bz2 -o wikipedia.segmented.txt
    chimera data tokenizer wikipedia.segmented.txt --vocab-size 30522
    chimera train --model bert-base --corpus wikipedia.segmented.txt
    chimera profile --model bert-tiny --micro-batch-sizes 1,2,4,8 --comm local -o profiles/bert-tiny.profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

from chimera.plan.cli import add_plan_parser
from chimera.profile.cli import add_profile_parser
from chimera.schedule import (
    CHIMERA_MODES,
    OFFLOAD_POLICIES,
    SCHEDULES,
    Costs,
    Offload,
    Schedule,
    ScheduleConfigError,
    ScheduleError,
    build_schedule,
    lower,
    simulate,
    to_csv,
    to_json,
    validate,
)


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise UsageError(f"{self.prog}: {message}")


def _number(text: str) -> Fraction | float:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help=f"schedule: {', '.join(SCHEDULES)}")
    p.add_argument("--stages", "-D", type=int, required=True, help="pipeline depth D (workers per pipeline)")
    p.add_argument("--micro-batches", "-N", type=int, required=True, help="micro-batches per iteration N")
    p.add_argument("--chunks", "-v", type=int, default=2, help="stages per worker v (interleaved only)")
    p.add_argument("--mode", default="direct", help=f"chimera N>D mode: {', '.join(CHIMERA_MODES)}")
    p.add_argument("--data-parallel", "-W", type=int, default=1, help="data-parallel width W")
    p.add_argument("--reverse-backward", action="store_true", help="GPipe: backward in reverse order")
    p.add_argument("--split-backward", action="store_true",
                   help="every backward as input-gradient I + weight-gradient W (Chimera: W fills its bubbles)")
    p.add_argument("--lowered", action="store_true", help="include send/recv, allreduce and optimizer actions")
    p.add_argument("--offload", default="none",
                   help=f"lowered with the swaps of this offload policy ({', '.join(OFFLOAD_POLICIES)}, or a comma "
                        "list with one per stage; implies --lowered)")
    p.add_argument("--prefetch", type=int, default=1, help="with --offload everything: swap-in depth")


def _schedule(args: argparse.Namespace, check: bool = True) -> Schedule:
    """The schedule the flags ask for; ``check``: validate it (a generator's schedule is valid by construction,
    and the simulator reports a deadlock itself, so simulate and plot skip it)."""
    if args.chunks < 1:
        raise ScheduleConfigError(f"--chunks (v) must be >= 1, got {args.chunks}")
    s = build_schedule(args.name, args.stages, args.micro_batches, chunks=args.chunks, mode=args.mode,
                       data_parallel=args.data_parallel, reverse_backward=args.reverse_backward,
                       split_backward=args.split_backward)
    if check:
        validate(s)
    if args.offload != "none":
        try:
            return lower(s, Offload(args.offload, args.prefetch))
        except ValueError as e:
            raise ScheduleConfigError(f"--offload {args.offload} --prefetch {args.prefetch}: {e}") from None
    return lower(s) if args.lowered else s


def _costs(args: argparse.Namespace) -> Costs:
    return Costs(fwd=args.fwd, bwd=args.bwd, wgrad=args.wgrad, p2p_latency=args.p2p_latency,
                 allreduce=args.allreduce, optimizer=args.optimizer, swap_in=args.swap_in, swap_out=args.swap_out)


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
    from chimera.schedule.best import best, ranking, table

    if args.stages < 1 or args.micro_batches < 1:
        raise UsageError("need --stages >= 1 and --micro-batches >= 1")
    if args.weight_memory < 0:
        raise UsageError(f"--weight-memory must be >= 0, got {args.weight_memory}")
    choice, ranked = best(args.stages, args.micro_batches, _costs(args), args.memory_limit,
                          halving=not args.no_halving, weight_memory=args.weight_memory)
    print(json.dumps(ranking(choice, ranked)) if args.json else table(choice, ranked))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from chimera.timeline.events import events_from_simulation
    from chimera.timeline.plot import plot_timeline, save_figure

    s = _schedule(args, check=False)
    r = simulate(s, _costs(args))
    title = (f"{s.name} D={s.stages} N={s.microbatches} (F={args.fwd}, B={args.bwd}, W={args.wgrad}): makespan "
             f"{float(r.makespan):g}, "
             f"bubble {float(r.bubble):.1%}")
    fig = plot_timeline(events_from_simulation(r), s.workers, title=title, time_unit="units")
    for path in save_figure(fig, args.output):
        print(path)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from chimera.data.wiki import PrepareError, prepare_wikipedia

    try:
        stats = prepare_wikipedia(args.dump, args.output, workers=args.workers, max_docs=args.max_docs,
                                  progress=not args.no_progress)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.output}: {stats.summary()}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from chimera.data.corpus import FAMILIES, CorpusError, tokenized_dir
    from chimera.data.tokenizer import build_tokenizers

    try:
        infos = build_tokenizers(args.corpus, args.family or FAMILIES, vocab_size=args.vocab_size,
                                 min_frequency=args.min_frequency, progress=not args.no_progress)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for family, info in infos.items():
        lengths = ", ".join(f"{info.longer_than(n - 3)} longer than {n - 3}" for n in (64, 128, 512))
        print(f"{family}: {info.vocab_size} tokens in the vocabulary; {info.documents} documents, {info.sentences} "
              f"sentences, {info.tokens} tokens (sentences: {lengths}) in {tokenized_dir(info.path, family)}/")
    return 0


class _Families:
    """The model families ``--family`` accepts, looked up on first use: chimera.data imports torch, which
    the schedule commands must not wait for."""

    def _names(self) -> tuple[str, ...]:
        from chimera.data.corpus import FAMILIES

        return FAMILIES

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())


def _add_data_parser(sub: Any) -> None:
    import os

    data = sub.add_parser("data", help="make a training corpus: Wikipedia dump -> sentences -> tokenizers, tokens")
    dsub = data.add_subparsers(dest="action", required=True, parser_class=_Parser)
    prep = dsub.add_parser("prepare", help="Wikipedia XML dump (.xml/.xml.bz2) -> one sentence per line, "
                                           "a blank line between documents")
    prep.add_argument("dump", help="pages-articles dump, .xml or .xml.bz2 (streamed)")
    prep.add_argument("-o", "--output", required=True, help="corpus text file to write")
    prep.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes cleaning pages")
    prep.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_prepare)
    tok = dsub.add_parser("tokenizer", help="train WordPiece (BERT) / byte-level BPE (GPT-2) tokenizers on a corpus "
                                            "and tokenize it into memory-mapped files next to it")
    tok.add_argument("corpus", help="segmented corpus (one sentence per line, a blank line between documents)")
    tok.add_argument("--family", nargs="+", choices=_Families(), metavar="FAMILY", default=None,
                     help="model families: %(choices)s (default: all)")
    tok.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size of each tokenizer")
    tok.add_argument("--min-frequency", type=int, default=2, help="minimum count of a merged token")
    tok.add_argument("--no-progress", action="store_true", help="no progress bar")
    tok.set_defaults(func=cmd_tokenizer)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="chimera", description="Chimera bidirectional pipeline parallelism on Ray")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sched = sub.add_parser("schedule", help="show, simulate or plot a pipeline schedule")
    ssub = sched.add_subparsers(dest="action", required=True, parser_class=_Parser)
    show = ssub.add_parser("show", help="print a schedule as text, CSV or JSON")
    _add_schedule_args(show)
    show.add_argument("--format", choices=("text", "csv", "json"), default="text")
    show.set_defaults(func=cmd_show)
    for name, func, helptext in (("simulate", cmd_simulate, "simulate one iteration"),
                                 ("plot", cmd_plot, "draw the simulated worker x time grid"),
                                 ("best", cmd_best, "simulate every schedule for D and N and pick the fastest")):
        p = ssub.add_parser(name, help=helptext)
        if name == "best":
            p.add_argument("--stages", "-D", type=int, required=True, help="pipeline depth D")
            p.add_argument("--micro-batches", "-N", type=int, required=True, help="micro-batches per iteration N")
            p.add_argument("--memory-limit", type=_number, default=None,
                           help="most memory a worker may hold, in micro-batches of activations: its peak "
                                "activations plus --weight-memory per share of the model it holds")
            p.add_argument("--weight-memory", type=_number, default=Fraction(0),
                           help="memory of one worker's share of the model (parameters, gradients, optimizer state) "
                                "in micro-batches of activations; a schedule holds 1 (1F1B) to 4 (chimera4) shares "
                                "(default 0: activations only)")
            p.add_argument("--no-halving", action="store_true",
                           help="leave out Chimera's backward halving (odd micro-batch size, or a unit's cost that "
                                "does not shrink with its size)")
        else:
            _add_schedule_args(p)
        p.add_argument("--fwd", type=_number, default=Fraction(1), help="forward time per micro-batch")
        p.add_argument("--bwd", type=_number, default=Fraction(2),
                       help="backward time per micro-batch (its input-gradient part when --wgrad is given)")
        p.add_argument("--wgrad", type=_number, default=Fraction(0),
                       help="weight-gradient time per micro-batch (a W; a whole backward costs --bwd + --wgrad)")
        p.add_argument("--p2p-latency", type=_number, default=Fraction(0), help="time of one p2p message")
        p.add_argument("--allreduce", type=_number, default=Fraction(0), help="gradient allreduce time per stage")
        p.add_argument("--optimizer", type=_number, default=Fraction(0), help="optimizer step time")
        p.add_argument("--swap-in", type=_number, default=Fraction(0), help="a stage's weights host -> device")
        p.add_argument("--swap-out", type=_number, default=Fraction(0), help="a stage's gradients device -> host")
        if name != "plot":
            p.add_argument("--json", action="store_true", help="print one JSON object")
        else:
            p.add_argument("-o", "--output", required=True, help="output file (.png/.pdf; no suffix: both)")
        p.set_defaults(func=func)
    add_plan_parser(sub)
    tl = sub.add_parser("timeline", help="timeline outputs of profiled runs")
    tsub = tl.add_subparsers(dest="action", required=True, parser_class=_Parser)
    tplot = tsub.add_parser("plot", help="rebuild trace, figure and summary of profiles/NAME.events.json")
    tplot.add_argument("name", help="run name (or path to NAME.events.json)")
    tplot.add_argument("--dir", default="profiles", help="folder of the profile files")
    tplot.add_argument("--sqlite", default=None, help="Nsight SQLite export: use GPU kernel times of the NVTX ranges")
    tplot.set_defaults(func=cmd_timeline_plot)
    train = sub.add_parser("train", add_help=False, help="train on Ray (the flags of scripts/prof_steps_ray.py; "
                                                        "chimera train --help lists them)")
    train.add_argument("args", nargs=argparse.REMAINDER)
    train.set_defaults(func=cmd_train)
    _add_data_parser(sub)
    add_profile_parser(sub)
    return parser


def cmd_timeline_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from chimera.timeline.nsight import events_from_nsys_sqlite
    from chimera.timeline.report import render

    path = Path(args.name) if args.name.endswith(".events.json") else Path(args.dir) / f"{args.name}.events.json"
    if not path.is_file():
        raise UsageError(f"no saved events at {path}; profile a run with --profile first")
    try:
        events = events_from_nsys_sqlite(args.sqlite) if args.sqlite else None
        paths = render(path, events=events)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    for p in paths.values():
        print(p)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Hand the flags to the Ray launcher (the library itself never imports Ray)."""
    try:
        from ray_launch import keep_local_ray_on_loopback
    except ImportError as e:  # pragma: no cover - ray_launch ships with chimera
        raise UsageError(f"chimera train needs the ray_launch package: {e}") from None
    keep_local_ray_on_loopback(args.args)
    try:
        from ray_launch.cli import main as train_main
    except ImportError as e:
        raise UsageError(f"chimera train runs on Ray, which does not import here ({e}); install it with "
                         "pip install -r requirements.txt -c constraints.txt") from None
    return train_main(args.args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``chimera`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["train"]:  # every flag after it is the launcher's (argparse's REMAINDER drops leading --x)
            return int(cmd_train(argparse.Namespace(args=argv[1:])) or 0)
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (UsageError, ScheduleConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ScheduleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

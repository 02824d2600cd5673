"""The ``chimera`` command line.

    chimera schedule show chimera --stages 4 --micro-batches 8 --format text
    chimera schedule simulate chimera --stages 4 --micro-batches 4 --fwd 1 --bwd 2 --json
    chimera schedule best -D 8 -N 16 --fwd 1 --bwd 1 --wgrad 1 --memory-limit-units 8
    chimera profile --model bert-tiny --micro-batch-sizes 1,2,4,8 --comm local -o profiles/bert-tiny.profile.json
    chimera plan --model bert-tiny --profile-file profiles/bert-tiny.profile.json --workers 4
    chimera data prepare enwiki-latest-pages-articles.xml.bz2 -o data/wikipedia.segmented.txt
    chimera timeline plot NAME
    chimera export ckpt --hf gpt2-tuned
    chimera train --model bert-base --corpus data/wikipedia.segmented.txt   # added by the Ray layer (ray_launch)

A command's module is loaded only when it runs (``chimera schedule`` imports no torch); another package adds its
commands with :func:`register_command` (the Ray layer adds ``train``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from chimera.cli.options import Parser, UsageError
from chimera.schedule import ScheduleConfigError, ScheduleError

#: command -> (module with ``add_parser(sub, parser_class)``, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "schedule": ("chimera.cli.schedule", "show, simulate, plot or rank pipeline schedules"),
    "profile": ("chimera.cli.profile", "profile a model's layers (and the communication) for the planner"),
    "plan": ("chimera.cli.plan", "choose schedule, D, W, B, N, recomputation, offload and partition from a profile"),
    "data": ("chimera.cli.data", "make a training corpus: Wikipedia dump -> sentences -> tokenizers, tokens"),
    "timeline": ("chimera.cli.timeline", "timeline outputs of profiled runs"),
    "export": ("chimera.cli.export", "write a checkpoint as a transformers directory or a torch state_dict"),
}


#: ``chimera profile --comm NAME`` -> "module:function" measuring it from the parsed flags (the Ray layer adds ``ray``)
PROBES: dict[str, str] = {"local": "chimera.cli.profile:local_probe"}


#: ``--log-level`` choices
LEVELS = ("debug", "info", "warning", "error")


class _Format(logging.Formatter):
    """Info lines as they are; other levels prefixed (``WARNING: ...``), debug ones with the logger's name."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno == logging.INFO:
            return text
        if record.levelno < logging.INFO:
            return f"{record.levelname} {record.name}: {text}"
        return f"{record.levelname}: {text}"


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to ``sys.stderr`` as it is at each record (not as it was when configured)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure_logging(level: str = "info") -> None:
    """Send the library's log records (``chimera.*``, ``ray_launch.*``) at ``level`` and above to stderr; called
    by every command (``chimera train --log-level`` chooses the level)."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h.formatter, _Format)), None)
    if handler is None:
        handler = _Stderr()
        handler.setFormatter(_Format("%(message)s"))
        root.addHandler(handler)
    for name in ("chimera", "ray_launch"):
        logging.getLogger(name).setLevel(level.upper())
    root.setLevel(min(logging.WARNING, logging.getLevelName(level.upper())))


def register_command(name: str, module: str, help: str) -> None:
    """Add a command whose module has ``add_parser(sub, parser_class)``."""
    COMMANDS[name] = (module, help)


def register_probe(name: str, target: str) -> None:
    """Add a way of measuring communication for ``chimera profile --comm NAME`` (``"module:function"``)."""
    PROBES[name] = target


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command listed and ``command``'s arguments built."""
    parser = Parser(prog="chimera", description="Chimera bidirectional pipeline parallelism on Ray",
                    epilog="commands: " + "; ".join(f"{k}: {h}" for k, (_, h) in COMMANDS.items()))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for name, (module, helptext) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(sub, Parser)
        else:  # listed only: `chimera NAME --help` builds it
            sub.add_parser(name, help=helptext, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``chimera`` console script (the Ray layer's ``ray_launch.cli.main`` adds ``train``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    configure_logging()
    try:
        args = build_parser(command).parse_args(argv)
        return int(args.func(args) or 0)
    except (UsageError, ScheduleConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ScheduleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""``chimera timeline plot``: rebuild a profiled run's trace, figure and summary from its saved events.

    chimera timeline plot NAME                         # runs/*/NAME.events.json (the newest), or profiles/
    chimera timeline plot NAME --sqlite report.sqlite  # GPU kernel times from an Nsight SQLite export
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from chimera.cli.options import UsageError
from chimera.timeline.nsight import events_from_nsys_sqlite
from chimera.timeline.report import render


def events_path(name: str, folder: str | None) -> Path:
    """The events file of run ``name``: a path, ``folder/NAME.events.json``, else the newest of every run directory
    under ``runs/`` and ``profiles/``."""
    if name.endswith(".events.json"):
        return Path(name)
    if folder is not None:
        return Path(folder) / f"{name}.events.json"
    found = [*Path("runs").glob(f"*/{name}.events.json"), *Path("profiles").glob(f"{name}.events.json")]
    return max(found, key=lambda p: p.stat().st_mtime) if found else Path("runs") / "*" / f"{name}.events.json"


def cmd_plot(args: argparse.Namespace) -> int:
    path = events_path(args.name, args.dir)
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


def add_parser(sub: Any, parser_class: type) -> None:
    """The ``timeline`` subcommand."""
    tl = sub.add_parser("timeline", help="timeline outputs of profiled runs")
    tsub = tl.add_subparsers(dest="action", required=True, parser_class=parser_class)
    plot = tsub.add_parser("plot", help="rebuild trace, figure and summary of profiles/NAME.events.json")
    plot.add_argument("name", help="run name (or path to NAME.events.json)")
    plot.add_argument("--dir", default=None, help="folder of the run's files (default: the newest run directory "
                      "under runs/ with that name, else profiles/)")
    plot.add_argument("--sqlite", default=None, help="Nsight SQLite export: use GPU kernel times of the NVTX ranges")
    plot.set_defaults(func=cmd_plot)

"""Schedule exchange formats: CSV (one row per worker, like torch.distributed.pipelining) and JSON; the CSV torch
itself writes (with its sends, receives and FSDP actions) is read by :mod:`chimera.schedule.torchpp`."""

from __future__ import annotations

import csv
import io
import json
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

from chimera.schedule.ir import Action, Kind, Schedule, ScheduleConfigError, from_rows
from chimera.schedule.torchpp import TorchCsvError, is_torch_csv, read_torch_csv
from chimera.schedule.validate import ScheduleError, validate


def to_csv(schedule: Schedule) -> str:
    """One row per worker; each cell one action in text form (no pipe prefix for single-direction)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    bi = schedule.bidirectional
    for row in schedule.actions:
        writer.writerow([a.text(bi) for a in row])
    return buf.getvalue()


def from_csv(text: str, *, name: str = "custom", microbatches: int | None = None, data_parallel: int = 1,
             microbatch_scale: Fraction = Fraction(1)) -> Schedule:
    """Parse :func:`to_csv` output, or the CSV torch.distributed.pipelining writes (told apart by
    :func:`~chimera.schedule.torchpp.is_torch_csv`; read by :func:`~chimera.schedule.torchpp.read_torch_csv`, which
    keeps its compute actions and checks ``microbatches`` against the file's where given)."""
    cells = list(csv.reader(io.StringIO(text)))
    if is_torch_csv(cells):
        return read_torch_csv(cells, name=name, microbatches=microbatches, data_parallel=data_parallel,
                              microbatch_scale=microbatch_scale).schedule
    rows = [[Action.parse(c) for c in r if c.strip()] for r in cells]
    return from_rows(rows, name=name, microbatches=microbatches, data_parallel=data_parallel,
                     microbatch_scale=microbatch_scale)


def action_dict(a: Action) -> dict[str, Any]:
    """JSON form of one action."""
    d: dict[str, Any] = {"kind": a.kind.value, "pipe": a.pipe, "stage": a.stage, "microbatch": a.microbatch}
    if a.count != 1:
        d["count"] = a.count
    return d


def to_dict(schedule: Schedule) -> dict[str, Any]:
    """JSON-ready dict: metadata, placement and ``workers`` (per worker, actions in execution order)."""
    return {
        "name": schedule.name,
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "data_parallel": schedule.data_parallel,
        "microbatch_scale": str(schedule.microbatch_scale),
        "lowered": schedule.lowered,
        "placement": [{"pipe": p, "stage": s, "worker": w} for (p, s), w in schedule.placement.items()],
        "workers": [[action_dict(a) for a in row] for row in schedule.actions],
    }


def to_json(schedule: Schedule, indent: int | None = None) -> str:
    return json.dumps(to_dict(schedule), indent=indent)


def from_dict(d: dict[str, Any]) -> Schedule:
    """Inverse of :func:`to_dict`; only ``workers`` is required."""
    rows = [
        [Action(Kind(x["kind"]), x.get("pipe", "down"), x.get("stage", -1), x.get("microbatch", -1), x.get("count", 1))
         for x in row]
        for row in d["workers"]
    ]
    s = from_rows(rows, name=d.get("name", "custom"), microbatches=d.get("microbatches"),
                  stages=d.get("stages"), data_parallel=d.get("data_parallel", 1),
                  microbatch_scale=Fraction(d.get("microbatch_scale", "1")))
    if "placement" in d:
        placement = {(x["pipe"], x["stage"]): x["worker"] for x in d["placement"]}
        if placement != dict(s.placement):
            raise ValueError("placement in JSON disagrees with where the actions are")
    return s


def from_json(text: str) -> Schedule:
    return from_dict(json.loads(text))


def load_schedule_file(path: str, stages: int, microbatches: int) -> Schedule:
    """A compute-only schedule from ``path`` (our JSON or CSV, or the CSV torch.distributed.pipelining writes),
    checked against ``stages`` workers and ``microbatches`` micro-batches and validated; :class:`ScheduleConfigError`
    (with the step x worker grid where the lists are wrong) says what to change.

    A torch CSV has one row per rank (``stages`` is the number of ranks) and may name more stages than ranks (the
    model is cut into as many stages as it names); its sends, receives and FSDP actions are dropped, with a
    warning that says so (:mod:`chimera.schedule.torchpp`)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ScheduleConfigError(f"--schedule-file {path}: cannot read it ({e.strerror})") from None
    try:
        s = _read_schedule_file(text, path, stages, microbatches)
    except TorchCsvError as e:
        raise ScheduleConfigError(f"--schedule-file {path} (a torch.distributed.pipelining CSV): {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ScheduleConfigError(f"--schedule-file {path}: not a schedule in our JSON or torch's CSV form: {e}"
                                  ) from None
    if s.lowered:
        raise ScheduleConfigError(f"--schedule-file {path}: give compute actions only (F, B, I, W); chimera adds the "
                                  "sends, receives, gradient sums and the optimizer step itself")
    if s.workers != stages or s.microbatches != microbatches:
        raise ScheduleConfigError(f"--schedule-file {path} has {s.workers} workers and {s.microbatches} micro-batches: "
                                  f"pass --stages {s.workers} --micro-batches {s.microbatches}")
    try:
        return validate(s)
    except ScheduleError as e:
        raise ScheduleConfigError(f"--schedule-file {path}: {e}") from None


def _read_schedule_file(text: str, path: str, ranks: int, microbatches: int) -> Schedule:
    """Our JSON, our CSV or torch's CSV; a torch CSV is checked against the flags cell by cell, and what it drops
    is said in a warning."""
    if text.lstrip().startswith("{"):
        return from_json(text)
    cells = list(csv.reader(io.StringIO(text)))
    if not is_torch_csv(cells):
        return from_csv(text, name=Path(path).stem)
    got = read_torch_csv(cells, name=Path(path).stem, ranks=ranks, microbatches=microbatches)
    if got.notes:
        warnings.warn(f"--schedule-file {path} (a torch.distributed.pipelining CSV): {'; '.join(got.notes)}",
                      stacklevel=3)
    return got.schedule

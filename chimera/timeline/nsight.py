"""Timeline events from an Nsight Systems SQLite export (``nsys export --type sqlite``).

chimera names every action's NVTX range like the action plus the rank and step, e.g. ``d0F3 [w0 it5]``
(a communication batch lists all its actions). Each range is mapped to the GPU time of the kernels its CUDA
runtime calls launched: the runtime calls made on the range's thread inside the range give correlation ids,
the kernels with those ids (in the same process) give [first kernel start, last kernel end]. A range
without kernels (a wait, a CPU-only action) keeps its CPU interval.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from chimera.schedule import Action
from chimera.timeline.events import Event

_NAME = re.compile(r"^(?P<actions>.+?)\s*\[w(?P<rank>\d+) it(?P<step>\d+)\]$")
_PID_MASK = ~0xFFFFFF  # nsys: globalTid = globalPid + tid (tid in the low 24 bits)


def _tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def events_from_nsys_sqlite(path: str | Path) -> list[Event]:
    """Parse chimera's NVTX ranges and map them to GPU kernel time; see the module docstring."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no Nsight SQLite export at {path} (make one with `nsys export --type sqlite`)")
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = _tables(con)
        if "NVTX_EVENTS" not in tables:
            raise ValueError(f"{path}: no NVTX_EVENTS table; was the run profiled with -t nvtx?")
        cols = {r[1] for r in con.execute("PRAGMA table_info(NVTX_EVENTS)")}
        if "textId" in cols and "StringIds" in tables:
            text = "COALESCE(n.text, s.value)"
            join = "LEFT JOIN StringIds s ON s.id = n.textId"
        else:
            text, join = "n.text", ""
        ranges = con.execute(f"SELECT n.start, n.end, {text}, n.globalTid FROM NVTX_EVENTS n {join} "
                             "WHERE n.end IS NOT NULL ORDER BY n.start").fetchall()
        have_gpu = {"CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL"} <= tables
        out: list[Event] = []
        for start, end, name, tid in ranges:
            m = _NAME.match(name or "")
            if not m:
                continue
            t0, t1 = start, end
            if have_gpu:
                row = con.execute(
                    "SELECT MIN(k.start), MAX(k.end) FROM CUPTI_ACTIVITY_KIND_RUNTIME r "
                    "JOIN CUPTI_ACTIVITY_KIND_KERNEL k ON k.correlationId = r.correlationId AND k.globalPid = ? "
                    "WHERE r.globalTid = ? AND r.start >= ? AND r.start <= ?",
                    (tid & _PID_MASK, tid, start, end)).fetchone()
                if row and row[0] is not None:
                    t0, t1 = row
            rank, step = int(m["rank"]), int(m["step"])
            for text_ in m["actions"].split():
                a = Action.parse(text_)
                out.append(Event(rank, a.kind.value, a.pipe, a.stage, a.microbatch, t0 / 1e9, t1 / 1e9, step, a.count))
        return out
    finally:
        con.close()

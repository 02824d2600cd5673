"""A toy extension, registered from outside the package: one schedule (a registry entry and its builder) and one
action kind (its row, its worker handler and its cost). ``tests/test_extend.py`` trains them; nothing else in
chimera knows them.

The schedule is 1F1B with one more warm-up forward per stage and a ``NOTE`` action after each stage's last
backward; a ``NOTE`` occupies its worker for the ``note`` cost in the simulator and sleeps ``NOTE_S`` in the
runtime, touching no tensor.
"""

from __future__ import annotations

import time

from chimera.runtime.handlers import register_handler
from chimera.schedule import DOWN, Action, Schedule, ScheduleSpec, register
from chimera.schedule.ir import B, F
from chimera.schedule.kinds import Address, KindSpec, Role, register_kind

NOTE_S = 0.02

NOTE = register_kind("NOTE", KindSpec("note", "NOTE", Role.COPY, Address.STAGE, cost="note", family="note",
                                      module=__name__))
register_handler(NOTE, lambda worker: lambda action, st: time.sleep(NOTE_S))


def eager_1f1b(stages: int, microbatches: int) -> Schedule:
    """min(D - s, N) warm-up forwards on stage s, then one backward and one forward, then the remaining backwards
    and a NOTE."""
    rows = []
    for s in range(stages):
        warm = min(stages - s, microbatches)
        row = [F(DOWN, s, m) for m in range(warm)]
        for m in range(warm, microbatches):
            row += [B(DOWN, s, m - warm), F(DOWN, s, m)]
        row += [B(DOWN, s, m) for m in range(microbatches - warm, microbatches)]
        row.append(Action(NOTE, DOWN, s))
        rows.append(row)
    return Schedule(stages=stages, microbatches=microbatches, placement={(DOWN, s): s for s in range(stages)},
                    actions=rows, name="eager-1f1b")


register(ScheduleSpec("eager-1f1b", eager_1f1b, "1F1B with one more warm-up forward and a note", backward=(False,),
                      auto=False))

"""Timeline events: one record per executed (or simulated) action."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    """One action's interval on one worker; times in seconds (or simulator units)."""

    worker: int
    kind: str
    pipe: str
    stage: int
    microbatch: int
    start: float
    end: float
    iteration: int = 0
    count: int = 1

    @property
    def duration(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def events_from_simulation(result: Any) -> list[Event]:
    """Events of a :class:`chimera.schedule.SimResult` (all actions, simulator time units)."""
    out = []
    sched = result.schedule
    for w, row in enumerate(sched.actions):
        for i, a in enumerate(row):
            out.append(Event(w, a.kind.value, a.pipe, a.stage, a.microbatch, float(result.starts[w][i]),
                             float(result.ends[w][i]), 0, a.count))
    return out

"""Timeline events: one record per executed (or simulated) action, named by its kind's code (``F``, ``SEND_F``,
``AR_START``, ``OPT``); how an event is drawn and counted follows its kind's row in the kinds table (its role and
display family)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from chimera.schedule.kinds import Kind

#: display families of offload's copies between host and device memory
SWAP_FAMILIES = ("swap-in", "swap-out", "grad-out")


def kind_of(code: str) -> Kind | None:
    """The kind an event names (codes, or the names of events written by earlier releases); None if unknown."""
    try:
        return Kind(code)
    except ValueError:
        return None


def family(code: str) -> str:
    """The display family of an event's kind (``other`` for a kind this process does not know)."""
    kind = kind_of(code)
    return kind.spec.family if kind is not None else "other"


def is_compute(code: str) -> bool:
    """Whether an event's kind computes (counts as busy)."""
    kind = kind_of(code)
    return kind is not None and kind.is_compute


def is_swap(code: str) -> bool:
    return family(code) in SWAP_FAMILIES


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

"""The executor: runs a worker's lowered action list once per step, each action by the handler of its kind.

The list is cut once into segments: one compute, sync or update action, or one communication batch (a run of
send/receive actions, posted at once by :class:`~chimera.runtime.comm.CommBatches`). A step is then a loop
that reads like the schedule. A kind with no handler is refused when the executor is built, before any step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from chimera.runtime.comm import CommBatches
from chimera.runtime.ledger import MemoryLedger
from chimera.runtime.step_state import StepState
from chimera.schedule import Action, Kind
from chimera.timeline.recorder import EventRecorder

Handler = Callable[[Action, StepState], None]


def segments(actions: Sequence[Action]) -> list[list[Action]]:
    """One segment per non-communication action, one per run of consecutive send/receive actions."""
    out: list[list[Action]] = []
    for a in actions:
        if a.kind.is_p2p and out and out[-1][0].kind.is_p2p:
            out[-1].append(a)
        else:
            out.append([a])
    return out


class Executor:
    """Dispatches every segment of one worker's action list (module docstring)."""

    def __init__(self, segs: Sequence[Sequence[Action]], handlers: Mapping[Kind, Handler], batches: CommBatches,
                 name: str) -> None:
        missing = sorted({a.kind.value for seg in segs for a in seg if not a.kind.is_p2p and a.kind not in handlers})
        if missing:
            raise RuntimeError(f"{name}: the runtime has no handler for action kind(s) {', '.join(missing)}; add one "
                               "in chimera.runtime.worker (see chimera.schedule.kinds)")
        self.segments = segs
        self.handlers = handlers
        self.batches = batches
        self.at: int | None = None  # the segment running now (None between steps): what a hang report shows

    def run(self, st: StepState, recorder: EventRecorder | None = None, ledger: MemoryLedger | None = None) -> None:
        """Execute the whole list once for step ``st.step`` (the ledger looks after every segment)."""
        for k, seg in enumerate(self.segments):
            self.at = k
            mark = recorder.begin(seg) if recorder else None
            if seg[0].kind.is_p2p:
                self.batches.exchange(k, st)
            else:
                self.handlers[seg[0].kind](seg[0], st)
            if recorder:
                recorder.end(seg, mark)
            if ledger:
                ledger.observe(st)
        self.at = None

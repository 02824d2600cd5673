"""The executor: runs a worker's lowered action list once per step, each action by the handler of its kind.

The list is cut once into segments: one compute, sync or update action, or one communication batch (a run of
send/receive actions, posted at once by :class:`~chimera.runtime.comm.CommBatches`), and resolved once into a
program of (handler, action) pairs, so a step looks nothing up. A kind with no handler is refused when the
executor is built, before any step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from chimera.runtime.batches import CommBatches
from chimera.runtime.handlers import Handler
from chimera.runtime.ledger import MemoryLedger
from chimera.runtime.step_state import StepState
from chimera.schedule import Action, Kind
from chimera.timeline.recorder import EventRecorder


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
            raise RuntimeError(f"{name}: the runtime has no handler for action kind(s) {', '.join(missing)}; register "
                               "one with chimera.runtime.handlers.register_handler")
        self.segments = segs
        exchange = batches.exchange
        # one bound call per segment: a communication batch by its index, any other action by its kind's handler
        self.program: list[tuple[Callable[..., None], object, Sequence[Action]]] = [
            (exchange, k, seg) if seg[0].kind.is_p2p else (handlers[seg[0].kind], seg[0], seg)
            for k, seg in enumerate(segs)]
        self.batches = batches
        self.at: int | None = None  # the segment running now (None between steps): what a hang report shows

    def run(self, st: StepState, recorder: EventRecorder | None = None, ledger: MemoryLedger | None = None) -> None:
        """Execute the whole list once for step ``st.step`` (the ledger looks after every segment)."""
        if recorder is None and ledger is None:  # the common step: nothing but the calls
            for k, (call, arg, _) in enumerate(self.program):
                self.at = k
                call(arg, st)
            self.at = None
            return
        for k, (call, arg, seg) in enumerate(self.program):
            self.at = k
            mark = recorder.begin(seg) if recorder else None
            call(arg, st)
            if recorder:
                recorder.end(seg, mark)
            if ledger:
                ledger.observe(st)
        self.at = None

"""Per-action timing inside a worker: NVTX ranges plus a monotonic clock (CPU) or CUDA events (GPU)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import nvtx
import torch

from chimera.schedule import Action
from chimera.timeline.events import Event


class EventRecorder:
    """Records one :class:`Event` per action of a step.

    On CPU times come from ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for all processes of a
    node). On GPU each action is bracketed by CUDA events on the current stream, converted at the end of the
    step against a reference event recorded right after a synchronisation, so times are GPU execution
    times on the same monotonic scale. Every action is also an NVTX range named like the action, with the
    rank and step in brackets (``d0F3 [w0 it5]``), which Nsight shows and ``chimera.timeline.nsight``
    parses back.
    """

    def __init__(self, rank: int, device: torch.device, bidirectional: bool) -> None:
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.bi = bidirectional
        self._marks: list[tuple[Sequence[Action], object, object]] = []
        self._step = 0
        self._t_ref = 0.0
        self._ref: torch.cuda.Event | None = None

    def start_step(self, step: int) -> None:
        self._marks = []
        self._step = step
        if self.cuda:
            torch.cuda.synchronize()
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
        self._t_ref = time.perf_counter()

    def _now(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin(self, actions: Sequence[Action]) -> object:
        """Open the range of ``actions`` (one action, or one communication batch)."""
        names = " ".join(a.text(self.bi) for a in actions)
        nvtx.push_range(f"{names} [w{self.rank} it{self._step}]")
        return self._now()

    def end(self, actions: Sequence[Action], start: object) -> None:
        self._marks.append((actions, start, self._now()))
        nvtx.pop_range()

    def finish(self) -> list[Event]:
        """The step's events (one per action, in execution order)."""
        out: list[Event] = []
        if self.cuda:
            torch.cuda.synchronize()
        for actions, s, e in self._marks:
            if self.cuda:
                assert self._ref is not None
                t0 = self._t_ref + self._ref.elapsed_time(s) / 1e3  # type: ignore[arg-type]
                t1 = self._t_ref + self._ref.elapsed_time(e) / 1e3  # type: ignore[arg-type]
            else:
                t0, t1 = float(s), float(e)  # type: ignore[arg-type]
            out.extend(Event(self.rank, a.kind.value, a.pipe, a.stage, a.microbatch, t0, t1, self._step, a.count)
                       for a in actions)
        self._marks = []
        return out

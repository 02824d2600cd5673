"""The execution engine shared by the validator and the simulator.

It runs every worker's list in order, as the runtime would, and times each action:

* F / B start when the worker is free and their inputs exist. In a compute-only schedule an input made
  on another worker arrives ``p2p(...)`` after it was made; in a lowered schedule it comes through the
  receive actions instead.
* Sends are non-blocking: the message leaves when the worker reaches the send and arrives ``p2p(...)``
  later. A receive blocks until its message has arrived. (The runtime posts a run of consecutive
  send/recv actions as one batch, keeps the send handles and waits only for the receives; NCCL/gloo
  match messages of one channel in order, which the validator checks separately.)
* ALLREDUCE_START is non-blocking; the allreduce of a stage ends ``allreduce(stage)`` after the last
  replica started it. ALLREDUCE_WAIT blocks until then.

Workers that cannot finish are reported as ``stuck`` with the reason, which the validator turns into
the step x worker grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chimera.schedule.ir import Action, Kind, Schedule

Key = tuple[Any, ...]


@dataclass
class Replay:
    """Start and end time of every action, per worker; ``stuck`` maps worker -> (index, reason)."""

    starts: list[list[Any]]
    ends: list[list[Any]]
    stuck: dict[int, tuple[int, str]] = field(default_factory=dict)


def message_key(a: Action, place: dict[tuple[str, int], int]) -> tuple[Key, int]:
    """The message a send/recv action carries and the peer worker: ``((what, pipe, src_stage, mb), peer)``."""
    p, s, m = a.pipe, a.stage, a.microbatch
    if a.kind is Kind.SEND_ACT:
        return ("act", p, s, m), place[(p, s + 1)]
    if a.kind is Kind.RECV_ACT:
        return ("act", p, s - 1, m), place[(p, s - 1)]
    if a.kind is Kind.SEND_GRAD:
        return ("grad", p, s, m), place[(p, s - 1)]
    if a.kind is Kind.RECV_GRAD:
        return ("grad", p, s + 1, m), place[(p, s + 1)]
    raise ValueError(f"{a} is not a send/recv action")


def _deps(a: Action, last: int) -> list[tuple[Key, str, int]]:
    """(key, pipe, stage-of-producer) of the results an F or B needs."""
    out = []
    for m in a.microbatches:
        if a.kind is Kind.F:
            if a.stage > 0:
                out.append((("F", a.pipe, a.stage - 1, m), a.pipe, a.stage - 1))
        else:
            out.append((("F", a.pipe, a.stage, m), a.pipe, a.stage))
            if a.stage < last:
                out.append((("B", a.pipe, a.stage + 1, m), a.pipe, a.stage + 1))
    return out


def replay(
    schedule: Schedule,
    compute: Callable[[Action], Any],
    p2p: Callable[[Key], Any],
    allreduce: Callable[[int], Any],
    optimizer: Any = 0,
) -> Replay:
    """Execute ``schedule`` with the given per-action durations; see the module docstring."""
    place = dict(schedule.placement)
    last = schedule.stages - 1
    rows = schedule.actions
    nw = len(rows)
    lowered = schedule.lowered
    zero = optimizer * 0
    starts: list[list[Any]] = [[None] * len(r) for r in rows]
    ends: list[list[Any]] = [[None] * len(r) for r in rows]
    pc = [0] * nw
    clock = [zero] * nw
    done: dict[Key, Any] = {}  # compute result / allreduce -> time it is available
    waiting: dict[Key, list[int]] = {}
    replicas: dict[int, int] = {}
    for _, s in place:
        replicas[s] = replicas.get(s, 0) + 1
    ar_arrivals: dict[int, list[Any]] = {}
    blocked: dict[int, str] = {}
    stack = list(range(nw - 1, -1, -1))

    def finish(key: Key, t: Any) -> None:
        done[key] = t
        stack.extend(waiting.pop(key, ()))

    def wait_for(w: int, i: int, key: Key, why: str) -> bool:
        """Blocking action ``i`` of worker ``w`` on ``key``: False (and registered) if not done yet."""
        if key not in done:
            waiting.setdefault(key, []).append(w)
            blocked[w] = why
            return False
        starts[w][i] = clock[w]
        clock[w] = max(clock[w], done[key])
        ends[w][i] = clock[w]
        return True

    def advance(w: int) -> None:
        row = rows[w]
        while pc[w] < len(row):
            i = pc[w]
            a = row[i]
            k = a.kind
            if k.is_compute:
                ready = clock[w]
                for key, pipe, st in _deps(a, last):
                    src = place[(pipe, st)]
                    if lowered and src != w:
                        continue
                    if key not in done:
                        waiting.setdefault(key, []).append(w)
                        what = "forward" if key[0] == "F" else "backward"
                        blocked[w] = f"{a.text()} needs the {what} of stage {st} micro-batch {key[3]} (worker {src})"
                        return
                    t = done[key] if src == w else done[key] + p2p((("act" if key[0] == "F" else "grad"),) + key[1:])
                    ready = max(ready, t)
                starts[w][i] = ready
                ends[w][i] = ready + compute(a)
                clock[w] = ends[w][i]
                pc[w] = i + 1
                for m in a.microbatches:
                    finish((k.value, a.pipe, a.stage, m), ends[w][i])
            elif k.is_p2p:
                key, peer = message_key(a, place)
                key = ("msg", *key)
                if k.is_send:  # eager: the message leaves now and arrives p2p() later
                    starts[w][i] = ends[w][i] = clock[w]
                    finish(key, clock[w] + p2p(key[1:]))
                elif not wait_for(w, i, key, f"{a.text()} waits for worker {peer} to send it"):
                    return
                pc[w] = i + 1
            elif k is Kind.ALLREDUCE_START:
                starts[w][i] = ends[w][i] = clock[w]
                arr = ar_arrivals.setdefault(a.stage, [])
                arr.append(clock[w])
                pc[w] = i + 1
                if len(arr) == replicas[a.stage]:
                    finish(("AR", a.stage), max(arr) + allreduce(a.stage))
            elif k is Kind.ALLREDUCE_WAIT:
                why = f"{a.text()} waits for the other replicas of stage {a.stage} to start the allreduce"
                if not wait_for(w, i, ("AR", a.stage), why):
                    return
                pc[w] = i + 1
            else:  # OPTIMIZER_STEP
                starts[w][i] = clock[w]
                clock[w] = clock[w] + optimizer
                ends[w][i] = clock[w]
                pc[w] = i + 1
        blocked.pop(w, None)

    while stack:
        advance(stack.pop())
    stuck = {w: (pc[w], blocked.get(w, "blocked")) for w in range(nw) if pc[w] < len(rows[w])}
    return Replay(starts, ends, stuck)

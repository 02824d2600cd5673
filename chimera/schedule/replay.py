"""The execution engine shared by the validator and the simulator.

It runs every worker's list in order, as the runtime would, and times each action:

* Each kind executes by its role in :mod:`chimera.schedule.kinds`. A compute action (F, B) starts when
  the worker is free and the resources it consumes exist. In a compute-only schedule a resource made on
  another worker arrives ``p2p(...)`` after it was made; in a lowered schedule it comes through the
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

from chimera.schedule.ir import Action, Schedule
from chimera.schedule.kinds import SPECS, Msg, Role, message, neighbour

Key = tuple[Any, ...]


@dataclass
class Replay:
    """Start and end time of every action, per worker; ``stuck`` maps worker -> (index, reason)."""

    starts: list[list[Any]]
    ends: list[list[Any]]
    stuck: dict[int, tuple[int, str]] = field(default_factory=dict)


def message_key(a: Action, place: dict[tuple[str, int], int]) -> tuple[Msg, int]:
    """The message a send/recv action carries and the peer worker."""
    msg, peer = message(a.kind, a.pipe, a.stage, a.microbatch)
    return msg, place[(a.pipe, peer)]


def inputs(a: Action, stages: int) -> list[tuple[Msg, int]]:
    """The resources a compute action waits for and the stage that makes each (from the kinds table)."""
    out = []
    for use in SPECS[a.kind].consumes:
        src = neighbour(a.stage, use.offset, stages)
        if src is not None:
            out.extend((Msg(use.res, a.pipe, src, m), src) for m in a.microbatches)
    return out


def replay(
    schedule: Schedule,
    cost: Callable[[Action], Any],
    p2p: Callable[[Msg], Any],
    allreduce: Callable[[int], Any],
) -> Replay:
    """Execute ``schedule``: ``cost(a)`` is the duration of a compute or update action, ``p2p(msg)`` a
    message's, ``allreduce(stage)`` a stage group's gradient sum; see the module docstring."""
    place = dict(schedule.placement)
    stages = schedule.stages
    rows = schedule.actions
    nw = len(rows)
    lowered = schedule.lowered
    starts: list[list[Any]] = [[None] * len(r) for r in rows]
    ends: list[list[Any]] = [[None] * len(r) for r in rows]
    pc = [0] * nw
    clock: list[Any] = [0] * nw
    done: dict[Key, Any] = {}  # resource / message / allreduce -> time it is available
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
            spec = SPECS[a.kind]
            role = spec.role
            if role is Role.COMPUTE:
                ready = clock[w]
                for key, st in inputs(a, stages):
                    src = place[(a.pipe, st)]
                    if lowered and src != w:
                        continue  # arrives through a receive action
                    if key not in done:
                        waiting.setdefault(key, []).append(w)
                        blocked[w] = (f"{a.text()} needs the {key.res.value} of stage {st} micro-batch "
                                      f"{key.microbatch} (made on worker {src})")
                        return
                    t = done[key] if src == w else done[key] + p2p(key)
                    ready = max(ready, t)
                starts[w][i] = ready
                ends[w][i] = ready + cost(a)
                clock[w] = ends[w][i]
                pc[w] = i + 1
                for res in spec.produces:
                    for m in a.microbatches:
                        finish(Msg(res, a.pipe, a.stage, m), ends[w][i])
            elif role is Role.SEND:  # eager: the message leaves now and arrives p2p() later
                key, _ = message_key(a, place)
                starts[w][i] = ends[w][i] = clock[w]
                finish(("msg", *key), clock[w] + p2p(key))
                pc[w] = i + 1
            elif role is Role.RECV:
                key, peer = message_key(a, place)
                if not wait_for(w, i, ("msg", *key), f"{a.text()} waits for worker {peer} to send it"):
                    return
                pc[w] = i + 1
            elif role is Role.SYNC_START:
                starts[w][i] = ends[w][i] = clock[w]
                arr = ar_arrivals.setdefault(a.stage, [])
                arr.append(clock[w])
                pc[w] = i + 1
                if len(arr) == replicas[a.stage]:
                    finish(("AR", a.stage), max(arr) + allreduce(a.stage))
            elif role is Role.SYNC_WAIT:
                why = f"{a.text()} waits for the other replicas of stage {a.stage} to start the allreduce"
                if not wait_for(w, i, ("AR", a.stage), why):
                    return
                pc[w] = i + 1
            elif role is Role.UPDATE:
                starts[w][i] = clock[w]
                clock[w] = clock[w] + cost(a)
                ends[w][i] = clock[w]
                pc[w] = i + 1
            else:  # pragma: no cover - every role of the kinds table is handled above
                raise ValueError(f"replay cannot execute {a.text()} (role {role})")
        blocked.pop(w, None)

    while stack:
        advance(stack.pop())
    stuck = {w: (pc[w], blocked.get(w, "blocked")) for w in range(nw) if pc[w] < len(rows[w])}
    return Replay(starts, ends, stuck)

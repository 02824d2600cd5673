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


class _Engine:
    """The state of one replay; one method per role of the kinds table."""

    def __init__(self, schedule: Schedule, cost: Callable[[Action], Any], p2p: Callable[[Msg], Any],
                 allreduce: Callable[[int], Any]) -> None:
        self.place = dict(schedule.placement)
        self.stages = schedule.stages
        self.rows = schedule.actions
        self.lowered = schedule.lowered
        self.cost, self.p2p, self.allreduce = cost, p2p, allreduce
        nw = len(self.rows)
        self.starts: list[list[Any]] = [[None] * len(r) for r in self.rows]
        self.ends: list[list[Any]] = [[None] * len(r) for r in self.rows]
        self.pc = [0] * nw
        self.clock: list[Any] = [0] * nw
        self.done: dict[Key, Any] = {}  # resource / message / allreduce -> time it is available
        self.waiting: dict[Key, list[int]] = {}
        self.replicas: dict[int, int] = {}
        for _, s in self.place:
            self.replicas[s] = self.replicas.get(s, 0) + 1
        self.arrivals: dict[int, list[Any]] = {}
        self.blocked: dict[int, str] = {}
        self.stack = list(range(nw - 1, -1, -1))
        by_role: dict[Role, Callable[[int, int, Action], bool]] = {
            Role.COMPUTE: self._compute, Role.SEND: self._send, Role.RECV: self._recv,
            Role.SYNC_START: self._sync_start, Role.SYNC_WAIT: self._sync_wait, Role.UPDATE: self._update}
        self.handler = {kind: by_role[spec.role] for kind, spec in SPECS.items()}
        # what a compute action makes that another compute action waits for (weight gradients wait for nobody)
        awaited = {u.res for spec in SPECS.values() if spec.role is Role.COMPUTE for u in spec.consumes}
        self.made = {kind: tuple(r for r in spec.produces if r in awaited) for kind, spec in SPECS.items()}

    def run(self) -> Replay:
        while self.stack:
            self._advance(self.stack.pop())
        stuck = {w: (self.pc[w], self.blocked.get(w, "blocked")) for w in range(len(self.rows))
                 if self.pc[w] < len(self.rows[w])}
        return Replay(self.starts, self.ends, stuck)

    def _advance(self, w: int) -> None:
        row = self.rows[w]
        while self.pc[w] < len(row):
            i = self.pc[w]
            a = row[i]
            if not self.handler[a.kind](w, i, a):
                return  # blocked; woken when what it waits for is done
            self.pc[w] = i + 1
        self.blocked.pop(w, None)

    def _finish(self, key: Key, t: Any) -> None:
        self.done[key] = t
        self.stack.extend(self.waiting.pop(key, ()))

    def _wait_for(self, w: int, i: int, key: Key, why: Callable[[], str]) -> bool:
        """Blocking action ``i`` of worker ``w`` on ``key``: False (and registered) if not done yet."""
        if key not in self.done:
            self.waiting.setdefault(key, []).append(w)
            self.blocked[w] = why()
            return False
        self.starts[w][i] = self.clock[w]
        self.clock[w] = max(self.clock[w], self.done[key])
        self.ends[w][i] = self.clock[w]
        return True

    def _compute(self, w: int, i: int, a: Action) -> bool:
        ready = self.clock[w]
        for key, st in inputs(a, self.stages):
            src = w if st == a.stage else self.place[(a.pipe, st)]
            if self.lowered and src != w:
                continue  # arrives through a receive action
            if key not in self.done:
                self.waiting.setdefault(key, []).append(w)
                self.blocked[w] = (f"{a.text()} needs the {key.res.value} of stage {st} micro-batch {key.microbatch} "
                                   f"(made on worker {src})")
                return False
            t = self.done[key] if src == w else self.done[key] + self.p2p(key)
            ready = max(ready, t)
        self.starts[w][i] = ready
        self.ends[w][i] = self.clock[w] = ready + self.cost(a)
        for res in self.made[a.kind]:
            for m in a.microbatches:
                self._finish(Msg(res, a.pipe, a.stage, m), self.ends[w][i])
        return True

    def _send(self, w: int, i: int, a: Action) -> bool:  # eager: the message leaves now, arrives p2p() later
        key, _ = message_key(a, self.place)
        self.starts[w][i] = self.ends[w][i] = self.clock[w]
        self._finish(("msg", *key), self.clock[w] + self.p2p(key))
        return True

    def _recv(self, w: int, i: int, a: Action) -> bool:
        key, peer = message_key(a, self.place)
        return self._wait_for(w, i, ("msg", *key), lambda: f"{a.text()} waits for worker {peer} to send it")

    def _sync_start(self, w: int, i: int, a: Action) -> bool:
        self.starts[w][i] = self.ends[w][i] = self.clock[w]
        arr = self.arrivals.setdefault(a.stage, [])
        arr.append(self.clock[w])
        if len(arr) == self.replicas[a.stage]:
            self._finish(("AR", a.stage), max(arr) + self.allreduce(a.stage))
        return True

    def _sync_wait(self, w: int, i: int, a: Action) -> bool:
        return self._wait_for(w, i, ("AR", a.stage),
                              lambda: f"{a.text()} waits for the other replicas of stage {a.stage} to start the allreduce")

    def _update(self, w: int, i: int, a: Action) -> bool:
        self.starts[w][i] = self.clock[w]
        self.ends[w][i] = self.clock[w] = self.clock[w] + self.cost(a)
        return True


def replay(
    schedule: Schedule,
    cost: Callable[[Action], Any],
    p2p: Callable[[Msg], Any],
    allreduce: Callable[[int], Any],
) -> Replay:
    """Execute ``schedule``: ``cost(a)`` is the duration of a compute or update action, ``p2p(msg)`` a
    message's, ``allreduce(stage)`` a stage group's gradient sum; see the module docstring."""
    return _Engine(schedule, cost, p2p, allreduce).run()

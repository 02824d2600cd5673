"""The execution engine shared by the validator and the simulator.

It runs every worker's list in order, as the runtime would, and times each action:

* Each kind executes by its role in :mod:`chimera.schedule.kinds`. A compute action (F, B) starts when
  the worker is free and the resources it consumes exist. In a compute-only schedule a resource made on
  another worker arrives ``p2p(...)`` after it was made; in a lowered schedule it comes through the
  receive actions instead.
* Sends are non-blocking: the message leaves when the worker has spent the send's busy time (posting it;
  0 unless the costs say) and arrives ``p2p(...)`` later. A receive blocks until its message has arrived,
  then takes its busy time. (The runtime posts a run of consecutive
  send/recv actions as one batch, keeps the send handles and waits only for the receives; NCCL/gloo
  match messages of one channel in order, which the validator checks separately.)
* A swap (role ``copy``) occupies its worker for its cost, like the optimizer step. A swap-in (role
  ``prefetch``) does too, unless the costs say copies run beside compute (``Costs.copy_overlap``, a GPU copy
  stream): then it takes no worker time and the stage's next compute on the worker waits until it has ended.
* ALLREDUCE_START is non-blocking (it takes its busy time, packing the gradients); the allreduce of a stage
  ends ``allreduce(stage)`` after the last replica started it. ALLREDUCE_WAIT blocks until then, then takes
  its busy time (unpacking the sum).

Whether an action can run depends on which actions have run, never on when, so a schedule is replayed
once without times into a :class:`Replay`: the order in which the actions ran, and for each action the
actions it waits for (with the delay slot it pays on top: a message, an allreduce). Timing the plan with
costs is then one pass over that order (:meth:`Replay.times`), as often as needed. Workers that cannot finish
are reported as ``stuck`` with the reason, which the validator turns into the step x worker grid.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any

from chimera.schedule.ir import Action, Schedule
from chimera.schedule.kinds import SPECS, Kind, Msg, Res, Role, message

Key = tuple[Any, ...]
Num = Any  # int, float or Fraction
_MSG, _AR = "msg", "AR"  # track tags: messages in flight, allreduces (a resource's track is (res, pipe, stage))
_AFTER = "after"  # track tag: actions that an ``after`` gate names, by flat index


def message_key(a: Action, place: dict[tuple[str, int], int]) -> tuple[Msg, int]:
    """The message a send/recv action carries and the peer worker."""
    msg, peer = message(a.kind, a.pipe, a.stage, a.microbatch)
    return msg, place[(a.pipe, peer)]


class Replay:
    """A schedule replayed once without times: what runs in which order, and what each action waits for.

    Action ``schedule.actions[w][i]`` has the flat index ``bounds[w] + i``. Delay slot 0 is free, slot
    ``1 + s`` is the allreduce of stage s, slot ``1 + stages + s`` a swap-in of stage s beside compute, slot
    ``1 + 2 stages + k`` the message ``messages[k]`` (one per resource, pipe and stage that sends). Duration slot 0 is free, slot ``1 + k`` is what action
    ``durations[k]`` costs (one per kind, stage and count).

    ``after`` (flat index -> flat indices) adds ordering edges beyond the kinds table: an action runs only after
    the ones it names have run and starts no earlier than their end (consecutive training steps use it:
    :mod:`chimera.schedule.steps`). The n-th gradient sum of a stage joins the n-th start of every replica.
    """

    def __init__(self, schedule: Schedule, after: Mapping[int, Sequence[int]] | None = None) -> None:
        b = _Build(schedule, after)
        b.run()
        self.actions = schedule.actions
        self.place = dict(schedule.placement)
        self.stages = schedule.stages
        self.bounds = b.bounds
        self.size = b.bounds[-1]
        self.order, self.prev, self.deps, self.slot = b.order, b.prev, b.deps, b.slot
        self.waits = b.waits  # (flat index, flat index of the worker's previous action) of blocking actions
        self.compute = b.compute  # per worker, flat indices of its compute actions
        self.messages: list[Msg] = b.messages
        self.durations: list[Action] = b.durations
        self.synced = sorted(b.synced)  # stages whose allreduce some action waits for
        self._stuck = {w: (b.pc[w], _blocked_key(b.blocked.get(w))) for w in range(len(self.actions))
                       if b.pc[w] < len(self.actions[w])}

    @cached_property
    def stuck(self) -> dict[int, tuple[int, str]]:
        """Workers that cannot finish: worker -> (index of the action it is stuck at, why)."""
        return {w: (i, self._reason(w, i, key)) for w, (i, key) in self._stuck.items()}

    def times(self, duration: Sequence[Num], delay: Sequence[Num]) -> tuple[list[Num], list[Num]]:
        """Start and end of every action (flat indices), given each duration slot's and delay slot's value.

        A compute, update, send or sync start starts when the worker is free and what it waits for is there
        (plus the delay); a blocking action starts when the worker reaches it and ends its duration after what
        it waits for is there.
        """
        if self._stuck:
            raise ValueError("a stuck plan has no times")
        end = [0] * (self.size + 1)  # end[size] stays 0: the "previous action" of each worker's first action
        start = [0] * self.size
        for i, p, deps, d in zip(self.order, self.prev, self.deps, self.slot):
            t = end[p]
            for q, s in deps:
                x = end[q] + delay[s]
                if x > t:
                    t = x
            start[i] = t
            end[i] = t + duration[d]
        for i, p in self.waits:
            start[i] = end[p]
        end.pop()
        return start, end

    def _reason(self, w: int, i: int, key: Key | None) -> str:
        a = self.actions[w][i]
        role = SPECS[a.kind].role
        if key is None:
            return "blocked"
        if key[0] == _AFTER:
            q = key[1]
            qw = bisect_right(self.bounds, q) - 1
            qa = self.actions[qw][q - self.bounds[qw]]
            return f"{a.text()} waits for {qa.text()} (worker {qw}, action {q - self.bounds[qw]}) to run first"
        if role is Role.RECV:
            _, peer = message(a.kind, a.pipe, a.stage, a.microbatch)
            return f"{a.text()} waits for worker {self.place.get((a.pipe, peer))} to send it"
        if role is Role.SYNC_WAIT:
            return f"{a.text()} waits for the other replicas of stage {a.stage} to start the allreduce"
        res, pipe, st, m = key
        src = w if st == a.stage else self.place.get((pipe, st))
        return f"{a.text()} needs the {res.value} of stage {st} micro-batch {m} (made on worker {src})"


class _Track:
    """One resource (or message) of one pipe and stage: its maker per micro-batch, and who waits for which."""

    __slots__ = ("key", "made", "waiting")

    def __init__(self, key: Key) -> None:
        self.key = key
        self.made: dict[Any, Any] = {}  # a micro-batch (a stage's gradient sum: stage and round) -> its maker
        self.waiting: dict[Any, list[int]] = {}


Deps = Sequence[tuple[int, int]]


def _blocked_key(blocked: tuple[_Track, Any] | None) -> Key | None:
    """What a stuck worker waits for, as (its track's key..., micro-batch)."""
    return None if blocked is None else (*blocked[0].key, blocked[1])
_RULED = (Role.COMPUTE, Role.SEND, Role.RECV, Role.SYNC_START, Role.SYNC_WAIT, Role.UPDATE, Role.COPY, Role.PREFETCH)


class _Build:
    """The replay without times behind :class:`Replay`; one method per role of the kinds table.

    A role's method returns what the action waits for, as ``(flat index, delay slot)`` pairs, and its
    duration slot; or None when it has to wait (the worker is woken when what it blocks on is made).
    """

    def __init__(self, schedule: Schedule, after: Mapping[int, Sequence[int]] | None = None) -> None:
        self.rows = schedule.actions
        self.place = dict(schedule.placement)
        self.stages = schedule.stages
        self.lowered = schedule.lowered
        self.bounds = [0]
        for row in self.rows:
            self.bounds.append(self.bounds[-1] + len(row))
        nw = len(self.rows)
        self.pc = [0] * nw
        self.last = [self.bounds[-1]] * nw  # flat index of each worker's last action run (none: the sentinel)
        self.tracks: dict[Key, _Track] = {}
        self.blocked: dict[int, tuple[_Track, Any]] = {}  # worker -> the track and micro-batch it waits for
        self.joins: dict[tuple[int, int], list[int]] = {}  # (stage, round) -> flat indices of its starts
        self.rounds: dict[tuple[Any, ...], int] = {}  # (role, worker, pipe, stage) -> sums started / awaited so far
        self.after = {k: tuple(v) for k, v in after.items()} if after else {}
        self.awaited = {q for v in self.after.values() for q in v}
        self.replicas: dict[int, int] = {}
        for _, s in self.place:
            self.replicas[s] = self.replicas.get(s, 0) + 1
        self.stack = list(range(nw - 1, -1, -1))
        self.order: list[int] = []
        self.prev: list[int] = []
        self.deps: list[Deps] = []
        self.slot: list[int] = []
        self.waits: list[tuple[int, int]] = []
        self.compute: list[list[int]] = [[] for _ in range(nw)]
        self.messages: list[Msg] = []
        self.message_slot: dict[tuple[Res, str, int], int] = {}
        self.durations: list[Action] = []
        self.duration_slot: dict[tuple[Any, int, int], int] = {}
        self.synced: set[int] = set()
        self.fetched: dict[tuple[int, str, int], int] = {}  # (worker, pipe, stage) -> its last swap-in
        self.templates: dict[Key, Any] = {}  # per kind, pipe, stage (count, worker): what its actions touch
        self._kinds()

    def _handlers(self) -> dict[Kind, Callable[[int, int, Action], tuple[Deps, int] | None]]:
        """Per kind, its role's method. Not kept on the instance: bound methods there would make every build a
        reference cycle, which only the cyclic collector frees (the planner pauses it)."""
        by_role: dict[Role, Callable[[int, int, Action], tuple[Deps, int] | None]] = {
            Role.COMPUTE: self._compute, Role.SEND: self._send, Role.RECV: self._recv,
            Role.SYNC_START: self._sync_start, Role.SYNC_WAIT: self._sync_wait, Role.UPDATE: self._update,
            Role.COPY: self._update, Role.PREFETCH: self._prefetch}
        return {kind: by_role[spec.role] for kind, spec in SPECS.items()}

    def _kinds(self) -> None:
        """Per kind, from the table: what it consumes, what it makes that others await (and that replay has a rule
        for its role)."""
        unknown = {spec.role for spec in SPECS.values()} - set(_RULED)
        if unknown:
            raise ValueError(f"replay has no rule for the role(s) {sorted(map(str, unknown))} of the kinds table")
        self.blocking = {kind: spec.role in (Role.RECV, Role.SYNC_WAIT) for kind, spec in SPECS.items()}
        self.uses = {kind: tuple((u.res, u.offset) for u in spec.consumes) for kind, spec in SPECS.items()}
        # what a compute action makes that another compute action waits for (weight gradients wait for nobody)
        awaited = {u.res for spec in SPECS.values() if spec.role is Role.COMPUTE for u in spec.consumes}
        self.made = {kind: tuple(r for r in spec.produces if r in awaited) for kind, spec in SPECS.items()}

    def run(self) -> None:
        handlers = self._handlers()
        rule = {kind: (handlers[kind], self.blocking[kind]) for kind in handlers}
        order, prev, deps_of, slot_of = self.order.append, self.prev.append, self.deps.append, self.slot.append
        waits, stack = self.waits, self.stack
        after, awaited, gated = self.after, self.awaited, bool(self.after)  # ordering edges: off the plain path
        gates, gate = self._track(_AFTER), None
        while stack:
            w = stack.pop()
            row, base, last, i = self.rows[w], self.bounds[w], self.last[w], self.pc[w]
            n = len(row)
            while i < n:
                a = row[i]
                k = base + i
                if gated:
                    gate = after.get(k)
                    if gate is not None and self._gated(w, gates, gate):
                        break
                handler, blocking = rule[a.kind]
                ran = handler(w, k, a)
                if ran is None:
                    break  # blocked; woken when what it waits for is made
                order(k)
                prev(last)
                deps_of(ran[0] if gate is None else (*ran[0], *((q, 0) for q in gate)))
                slot_of(ran[1])
                if blocking:
                    waits.append((k, last))
                last = k
                i += 1
                if gated and k in awaited:
                    self._finish(gates, k, k)
            else:
                self.blocked.pop(w, None)
            self.pc[w], self.last[w] = i, last

    def _track(self, *key: Any) -> _Track:
        t = self.tracks.get(key)
        if t is None:
            t = self.tracks[key] = _Track(key)
        return t

    def _gated(self, w: int, gates: _Track, gate: tuple[int, ...]) -> bool:
        """Whether an action of ``w`` that waits for the actions ``gate`` must wait (then ``w`` is blocked)."""
        for q in gate:
            if q not in gates.made:
                self._block(w, gates, q)
                return True
        return False

    def _finish(self, track: _Track, m: Any, made_by: Any) -> None:
        track.made[m] = made_by
        if track.waiting and m in track.waiting:
            self.stack.extend(track.waiting.pop(m))

    def _block(self, w: int, track: _Track, m: Any) -> None:
        track.waiting.setdefault(m, []).append(w)
        self.blocked[w] = (track, m)  # the key only if the worker stays stuck (Replay._stuck)

    def _duration(self, a: Action) -> int:
        k = (a.kind, a.stage, a.count)
        slot = self.duration_slot.get(k)
        if slot is None:
            self.durations.append(a)
            slot = self.duration_slot[k] = len(self.durations)
        return slot

    def _message(self, key: Msg) -> int:
        slot = self.message_slot.get(key[:3])
        if slot is None:
            self.messages.append(key)
            slot = self.message_slot[key[:3]] = 2 * self.stages + len(self.messages)
        return slot

    def _compute(self, w: int, i: int, a: Action) -> tuple[Deps, int] | None:
        first, count = a.microbatch, a.count
        template = self.templates.get((a.kind, a.pipe, a.stage, count, w))
        if template is None:
            template = self.templates[(a.kind, a.pipe, a.stage, count, w)] = self._compute_template(w, a)
        needs, makes, slot = template
        deps = []
        if count == 1:
            for track, delay in needs:
                made_by = track.made.get(first)
                if made_by is None:
                    return self._block(w, track, first)
                deps.append((made_by, delay))
        else:
            for track, delay in needs:
                for m in range(first, first + count):
                    made_by = track.made.get(m)
                    if made_by is None:
                        return self._block(w, track, m)
                    deps.append((made_by, delay))
        if self.fetched:
            fetched = self.fetched.get((w, a.pipe, a.stage))
            if fetched is not None:  # the weights' copy ends before the compute starts
                deps.append((fetched, 1 + self.stages + a.stage))
        self.compute[w].append(i)
        for track in makes:  # made: wake whoever waits for it (_finish, inline)
            made, waiting = track.made, track.waiting
            if count == 1:
                made[first] = i
                if waiting and first in waiting:
                    self.stack.extend(waiting.pop(first))
                continue
            for m in range(first, first + count):
                made[m] = i
                if waiting and m in waiting:
                    self.stack.extend(waiting.pop(m))
        return deps, slot  # a list: times() only iterates it

    def _compute_template(self, w: int, a: Action) -> tuple[tuple[tuple[_Track, int], ...], tuple[_Track, ...], int]:
        """What compute actions of this kind, pipe, stage and count on worker ``w`` wait for (the resource's
        track, the delay slot) and make; inputs from the data or the loss, or (lowered) from a receive, drop out."""
        needs = []
        for res, offset in self.uses[a.kind]:
            src = a.stage + offset
            if src == a.stage or (0 <= src < self.stages and self.place.get((a.pipe, src)) == w):
                needs.append((self._track(res, a.pipe, src), 0))
            elif 0 <= src < self.stages and not self.lowered:
                needs.append((self._track(res, a.pipe, src), self._message(Msg(res, a.pipe, src, a.microbatch))))
        makes = tuple(self._track(res, a.pipe, a.stage) for res in self.made[a.kind])
        return tuple(needs), makes, self._duration(a)

    def _message_template(self, a: Action) -> tuple[_Track, int, int]:
        """A send's or receive's message track and delay slot (per kind, pipe and stage) and duration slot."""
        key = (a.kind, a.pipe, a.stage, a.count)
        template = self.templates.get(key)
        if template is None:
            msg, _ = message(a.kind, a.pipe, a.stage, a.microbatch)
            template = self.templates[key] = (self._track(_MSG, *msg[:3]), self._message(msg), self._duration(a))
        return template

    def _send(self, w: int, i: int, a: Action) -> tuple[Deps, int]:  # leaves after its busy time, arrives p2p() later
        track, delay, slot = self.templates.get((a.kind, a.pipe, a.stage, a.count)) or self._message_template(a)
        m = a.microbatch
        track.made[m] = (i, delay)  # _finish, inline
        if track.waiting and m in track.waiting:
            self.stack.extend(track.waiting.pop(m))
        return (), slot

    def _recv(self, w: int, i: int, a: Action) -> tuple[Deps, int] | None:
        track, _, slot = self.templates.get((a.kind, a.pipe, a.stage, a.count)) or self._message_template(a)
        sent = track.made.get(a.microbatch)
        if sent is None:
            return self._block(w, track, a.microbatch)
        return (sent,), slot

    def _round(self, role: Role, w: int, a: Action) -> int:
        return self.rounds.get((role, w, a.pipe, a.stage), 0)

    def _sync_start(self, w: int, i: int, a: Action) -> tuple[Deps, int]:
        r = self._round(Role.SYNC_START, w, a)
        self.rounds[(Role.SYNC_START, w, a.pipe, a.stage)] = r + 1
        started = self.joins.setdefault((a.stage, r), [])
        started.append(i)
        if len(started) == self.replicas.get(a.stage):
            self._finish(self._track(_AR), (a.stage, r), tuple(started))
        return (), self._duration(a)

    def _sync_wait(self, w: int, i: int, a: Action) -> tuple[Deps, int] | None:
        track = self._track(_AR)
        r = self._round(Role.SYNC_WAIT, w, a)
        started = track.made.get((a.stage, r))
        if started is None:
            return self._block(w, track, (a.stage, r))
        self.rounds[(Role.SYNC_WAIT, w, a.pipe, a.stage)] = r + 1
        self.synced.add(a.stage)
        return tuple((j, 1 + a.stage) for j in started), self._duration(a)

    def _update(self, w: int, i: int, a: Action) -> tuple[Deps, int]:
        return (), self._duration(a)

    def _prefetch(self, w: int, i: int, a: Action) -> tuple[Deps, int]:
        self.fetched[(w, a.pipe, a.stage)] = i
        return (), self._duration(a)

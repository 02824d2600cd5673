"""The memory model: the peak bytes each worker holds for a configuration, from a profile.

A worker holds, for each of its stage replicas (both Chimera replicas), the parameters and the optimizer state
for the whole step, and the gradients from the stage's first backward until the optimizer step. On top come
what its schedule stashes for the backward (walked action by action: a forward stashes one unit per
micro-batch, a backward releases it), the buffers of its messages (a send's until the peer has it, as on gloo and
NCCL; same-host shared memory copies it when posted, so there the runtime holds less), and the gradient sum's
buffers. With post-validated steps (a schedule lowered with STAGE_UPDATE actions) each update keeps a copy of its
stage's weights and optimizer state until the next step's first update takes the step's verdict, and the step's
gradients are set aside until then (``rollback``: the previous step's copies and gradients from the step's start
to its first update, then this step's copies). With the optimizer state sharded (ZeRO-1,
``optimizer_owned``) only the owned share of a stage's state counts. The peak is
taken over the worker's action list, so it follows the schedule's order exactly::

    mem = worker_memory(profile, compute_only_schedule, stage_layers, unit=4, optimizer="adamw", recompute=False)
    max(m.total for m in mem)

Per unit and stage: without recomputation the stash is what the stage's layers save for the backward
(``stash_bytes``); with it, the stage's input (and, while one backward recomputes, that unit's full stash).
Gradient sums: a flat copy of the stage's gradients from the sum's start to its wait (which writes the sum back
into the gradients), and on gloo for a pair of replicas also the peer's bucket, received into a buffer posted when
the step starts, until the same wait.

With offload (a schedule lowered with ``Offload``), for every stage by that stage's policy, the device holds no
optimizer state, gradients only from a backward to their GRAD_OUT (gradient sums then run over host buffers), and,
with weights offloaded, a stage's weights only from its SWAP_IN to its SWAP_OUT; with weights in packs
(``StageOffload.pack``) only during the stage's own forwards and backwards, at most two consecutive packs at once,
and gradients only while its backward makes them (each leaves as soon as it is accumulated): the largest pack's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import ge, mul
from typing import Any

from chimera.offload.policy import Offload
from chimera.profile import Profile
from chimera.schedule import Action, Kind, Schedule
from chimera.schedule.kinds import SPECS, activation_change


@dataclass(frozen=True)
class WorkerMemory:
    """Bytes one worker holds at its peak, by category."""

    params: int
    optimizer: int
    grads: int
    activations: int
    messages: int
    sync: int
    rollback: int = 0  # post-validated updates: the copies of the updated stages' weights and optimizer state

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.grads + self.activations + self.messages + self.sync + self.rollback


@dataclass(frozen=True)
class _Stage:
    params: int
    bucket: int  # the gradients summed by the stage's buckets: parameters tied to another stage are summed apart
    optimizer: int
    stash: int  # one unit, as kept until the backward
    full_stash: int  # one unit without recomputation
    msg_in: int  # one unit's received activation
    msg_out: int  # one unit's sent activation
    pack_peak: int = 0  # weights in packs (Offload.pack): the largest two consecutive packs, on the device together
    pack_max: int = 0  # weights in packs: the largest pack (its gradients, on their way to the host, at most)


def _stages(profile: Profile, stage_layers: Sequence[Sequence[int]], unit: int, optimizer: str,
            recompute: bool, offload: Offload | None = None) -> list[_Stage]:
    out = []
    last = len(stage_layers) - 1
    for s, layers in enumerate(stage_layers):
        pack = offload.at(s).pack if offload is not None and offload.packed_at(s) else 0
        costs = [profile.cost(i, unit) for i in layers]
        full = sum(c.stash_bytes for c in costs) + costs[0].input_bytes
        kept = costs[0].input_bytes if recompute and s < last else full
        params = sum(profile.layers[i].param_bytes for i in layers)
        opt = sum(profile.layers[i].optimizer_bytes.get(optimizer, 0) for i in layers)
        apart = profile.tied_apart(layers)
        shared = profile.tied_within(layers)  # both ends here: one parameter, listed in both layers' counts
        within = sum(b for _, b in shared)
        opt_within = sum(profile.layers[i].optimizer_bytes.get(optimizer, 0) * b
                         // max(1, profile.layers[i].param_bytes) for i, b in shared)
        packs = [sum(profile.layers[i].param_bytes for i in layers[j:j + pack])
                 for j in range(0, len(layers), pack)] if pack else []
        peak = max((a + b for a, b in zip(packs, packs[1:])), default=sum(packs))
        out.append(_Stage(params - within, params - within - apart, opt - opt_within, kept, full,
                          costs[0].input_bytes if s > 0 else 0, costs[-1].output_bytes if s < last else 0, peak,
                          max(packs, default=0)))
    return out


class MemoryWalk:
    """What a schedule's order implies for memory, whatever the partition: for every worker, the distinct states
    its action list passes through, as counts per stage it holds (units stashed, gradients allocated, a
    recomputation's transient units, messages out and in, a flat gradient copy, weights resident, a rollback copy,
    the sum waited for, the previous step's rollback copy and gradients).
    Walked once per schedule; a partition is then priced by a dot product per state."""

    def __init__(self, schedule: Schedule) -> None:
        self.workers = [self._walk(schedule, w) for w in range(schedule.workers)]
        #: per worker, each state's counts but the last (what a stage computes now) as one tuple
        self.flat = [[sum(state[:10], ()) for state in states] for _, _, states in self.workers]

    @staticmethod
    def _walk(schedule: Schedule, w: int) -> tuple[list[int], list[int], list[tuple[tuple[int, ...], ...]]]:
        pairs = schedule.stages_of(w)
        held = [s for _, s in pairs]
        groups = [schedule.stage_group_size(s) for s in held]
        n = len(held)
        zero = (0,) * n
        row = schedule.actions[w]
        # post-validated (a row that keeps rollback copies): the previous step's copies and gradients are held from
        # the step's start until its first update takes their verdict (chimera.runtime.post_validate)
        carried = (1,) * n if schedule.lowered and any(SPECS[a.kind].memory.saved for a in row) else zero
        leaving = {k for k, spec in SPECS.items() if spec.memory.resident is False}
        evicted = {(a.pipe, a.stage) for a in row if a.kind in leaving}  # start off device
        resident = tuple(int(ps not in evicted) for ps in pairs)
        seen, by_index, live, grads, resident = _visit(row, {ps: k for k, ps in enumerate(pairs)}, carried, resident)
        # the same set, built from the distinct states in the same order: it iterates alike
        states: set[tuple[tuple[int, ...], ...]] = set()
        for live_at, r in seen:
            states.add((live_at, *by_index[r]))
        if not schedule.lowered:  # the step's end: every stage's gradient sum started (a lowered list says when)
            states.add((live, grads, zero, zero, zero, tuple(int(g > 1) for g in groups), resident, zero,
                        zero, zero, zero))
        return held, groups, _maximal(states)


def _put(vec: tuple[int, ...], k: int, v: int) -> tuple[int, ...]:
    return tuple(v if i == k else x for i, x in enumerate(vec))


@lru_cache(maxsize=4096)
def _at(n: int, k: int, c: int) -> tuple[int, ...]:
    """``c`` at stage slot ``k`` of ``n``, zero elsewhere."""
    return tuple(c if i == k else 0 for i in range(n))


_State = tuple[tuple[int, ...], ...]


def _visit(row: Sequence[Action], slot: Mapping[tuple[str, int], int], carried: tuple[int, ...],
           resident: tuple[int, ...]) -> tuple[dict[tuple[tuple[int, ...], int], None], list[_State], tuple[int, ...],
                                               tuple[int, ...], tuple[int, ...]]:
    """Every action of ``row`` by its row of the kinds table (its memory effect and activation change): the distinct
    states where the peak can fall, in the order first seen, keyed by their stash counts and the index of the rest
    in the returned list (which changes rarely: hashing the whole nested state per action was most of the walk);
    then the stash counts, gradients and residency at the row's end."""
    n = len(carried)
    zero = (0,) * n
    put = _put
    live = [0] * n
    grads, flats, saved, waited = zero, zero, zero, zero
    seen: dict[tuple[tuple[int, ...], int], None] = {}
    rests: dict[_State, int] = {}
    rest_of: dict[tuple[Any, ...], int] = {}  # per action shape while grads, flats, resident hold
    effects = {kind: _effect(kind) for kind in SPECS}
    # per action shape (kind, pipe, stage, count): what _shape says; None for an action of no stage (the optimizer)
    shapes: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}
    for a in row:
        shape = (a.kind, a.pipe, a.stage, a.count)
        info = shapes.get(shape, ())
        if info == ():
            info = shapes[shape] = _shape(a, slot, effects)
        if info is None:
            continue
        k, change, g, flat, res, peak, recompute, out, inn, pack, keep = info
        if change > 0:
            live[k] += change
        if g and not grads[k]:
            grads = put(grads, k, 1)
            rest_of = {}
        if flat and not flats[k]:
            flats = put(flats, k, 1)
            rest_of = {}
        if res and not resident[k]:
            resident = put(resident, k, 1)
            rest_of = {}
        if keep and not saved[k]:
            saved, carried = put(saved, k, 1), zero
            rest_of = {}
        if peak:
            r = rest_of.get(shape)
            if r is None:
                c = _at(n, k, a.count)
                rest = (grads, c if recompute else zero, c if out else zero, c if inn else zero, flats, resident,
                        saved, waited, carried, _at(n, k, 1) if pack else zero)
                r = rest_of[shape] = rests.setdefault(rest, len(rests))
            seen[(tuple(live), r)] = None
        if change < 0:
            live[k] += change
        if g is False and grads[k]:
            grads = put(grads, k, 0)
            rest_of = {}
        if flat is False and not waited[k]:
            flats, waited = put(flats, k, 0), put(waited, k, 1)
            rest_of = {}
        if res is False and resident[k]:
            resident = put(resident, k, 0)
            rest_of = {}
    return seen, list(rests), tuple(live), grads, resident


def _shape(a: Action, slot: Mapping[tuple[str, int], int], effects: Mapping[Kind, tuple[Any, ...]]
           ) -> tuple[Any, ...] | None:
    """An action's stage slot, activation change (times its count) and the rest of its kind's memory effect; None
    for an action of no stage held here (the optimizer step)."""
    k = slot.get((a.pipe, a.stage))
    if k is None:
        return None
    e = effects[a.kind]
    return (k, e[0] * a.count, *e[1:])


def _effect(kind: Kind) -> tuple[Any, ...]:
    """What an action of ``kind`` does to memory, flat: activation change per unit, gradients, flat buffer,
    residency (True: on, False: off, None: no change), whether it can be the peak, its transients, whether it keeps a
    rollback copy."""
    m = SPECS[kind].memory
    t = m.transient
    return (activation_change(kind), m.grads, m.flat, m.resident, m.peak, "recompute" in t, "out" in t, "in" in t,
            "pack" in t, m.saved)


def _maximal(states: set[tuple[tuple[int, ...], ...]]) -> list[tuple[tuple[int, ...], ...]]:
    """The states no other state dominates (every count at least as large): only those can be the peak. States
    that differ only in their stash counts are compared on those alone."""
    groups: dict[tuple[tuple[int, ...], ...], list[tuple[int, ...]]] = {}
    for live, *rest in states:
        groups.setdefault(tuple(rest), []).append(live)
    keep = []
    for rest, lives in groups.items():
        ordered = sorted(lives, key=sum, reverse=True)
        front = _front(ordered) if len(ordered[0]) <= 2 else _front_scan(ordered)
        keep += [(live, *rest) for live in front]
    return keep


def _front_scan(ordered: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The distinct ``ordered`` (by sum, largest first) that no other dominates, in that order: each is dominated
    only by one of larger sum, so by one already kept."""
    front: list[tuple[int, ...]] = []
    for live in ordered:
        if not any(all(map(ge, f, live)) for f in front):
            front.append(live)
    return front


def _front(ordered: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """:func:`_front_scan` of one or two counts, by a sweep (the same set; kept in ``ordered``'s order): by the first
    count, largest first (the second breaking ties), a pair is undominated when its second count beats every
    second count before it."""
    if len(ordered[0]) <= 1:  # distinct single counts: the largest alone
        return ordered[:1]
    best, kept = None, set()
    for live in sorted(ordered, reverse=True):
        if best is None or live[1] > best:
            kept.add(live)
            best = live[1]
    return [live for live in ordered if live in kept]


def worker_memory(profile: Profile, schedule: Schedule, stage_layers: Sequence[Sequence[int]], unit: int,
                  optimizer: str, recompute: bool, exchange: bool = True, walk: MemoryWalk | None = None,
                  offload: Offload | None = None, optimizer_owned: Sequence[Mapping[int, int]] | None = None
                  ) -> list[WorkerMemory]:
    """Peak bytes of every worker of one data-parallel group (module docstring).

    ``schedule``: compute-only or lowered (``walk``: its :class:`MemoryWalk`, when already made); ``exchange``:
    gloo, where a pair of replicas sums gradients by exchanging buckets (the peer's bucket lands in a buffer
    posted at the step's start); ``offload``: the policy the schedule was lowered with; ``optimizer_owned``
    (ZeRO-1, ``OptimizerShards.per_worker``): per worker, stage -> the parameter bytes whose optimizer state it keeps
    (a stage not listed: all of it).
    """
    off = offload or Offload()
    stages = _stages(profile, stage_layers, unit, optimizer, recompute, off)
    walk = walk or MemoryWalk(schedule)
    owned = optimizer_owned or [{}] * len(walk.workers)
    return [_worker(held, groups, states, stages, exchange, off, flat, own)
            for (held, groups, states), flat, own in zip(walk.workers, walk.flat, owned)]


def memory_ceiling(profile: Profile, frame: Schedule, stage_layers: Sequence[Sequence[int]], unit: int,
                   optimizer: str, exchange: bool = True, post_validated: bool = False) -> int:
    """Bytes no worker exceeds in any order of ``frame``'s actions, compute-only or lowered (``post_validated``:
    also post-validated), without recomputation or offload (its placement and units are read, not its actions: a
    frame will do): :func:`worker_memory`'s pricing of one state holding every unit of every stage it holds
    stashed, every gradient, every gradient sum's buffer, every unit's messages and (``post_validated``) every
    rollback copy at once, no sum waited for yet. Every state an order passes through has each count at most that
    (and no fewer sums outstanding), and the pricing only grows with each count, so the peak is at most this."""
    stages = _stages(profile, stage_layers, unit, optimizer, False)
    most = max((activation_change(k) for k in SPECS), default=1)
    out = 0
    for w in range(frame.workers):
        pairs = frame.stages_of(w)
        held = [s for _, s in pairs]
        groups = [frame.stage_group_size(s) for s in held]
        units = tuple(frame.pipe_microbatches(p) * most for p, _ in pairs)
        ones, zero = (1,) * len(held), (0,) * len(held)
        # post-validated: the previous step's copies and gradients (more than this step's copies alone)
        state = (units, ones, zero, units, units, tuple(int(g > 1) for g in groups), ones, zero, zero,
                 ones if post_validated else zero, zero)
        out = max(out, _worker(held, groups, [state], stages, exchange, Offload()).total)
    return out


def _worker(held: list[int], groups: list[int], states: Sequence[tuple[tuple[int, ...], ...]], stages: list[_Stage],
            exchange: bool, offload: Offload, flat: Sequence[tuple[int, ...]] | None = None,
            owned: Mapping[int, int] | None = None) -> WorkerMemory:
    """The peak of one worker over its ``states`` (``flat``: the same states as one tuple of their first ten
    counts each, :attr:`MemoryWalk.flat`, which prices them faster where no stage moves weights in packs;
    ``owned``: ZeRO-1's owned parameter bytes per stage)."""
    st = [stages[s] for s in held]
    owned = owned or {}
    # sharded (ZeRO-1): the state of the parameter bytes owned, at the stage's state per parameter byte
    opt = sum(x.optimizer * owned[s] // max(1, x.params) if s in owned else x.optimizer
              for s, x in zip(held, st) if not offload.optimizer_at(s))
    # offloaded gradients are summed over host buffers: no device buffers for that stage's sum
    device_sync = [not offload.gradients_at(s) for s in held]
    # the peer's bucket, posted at the step's start, until the stage's sum is waited for
    posted = [x.bucket if exchange and n == 2 and d else 0 for x, n, d in zip(st, groups, device_sync)]
    preposted = sum(posted)
    extra = [x.full_stash if x.stash != x.full_stash else 0 for x in st]  # a recomputing backward's transient
    packed = [offload.packed_at(s) for s in held]
    summed = [x.bucket if n > 1 and d else 0 for x, n, d in zip(st, groups, device_sync)]
    copies = [x.params + x.optimizer for x in st]  # post-validation keeps the whole state (no sharding, no offload)
    carry = [c + x.params for c, x in zip(copies, st)]  # the previous step's copies and its gradients

    def priced(state: tuple[tuple[int, ...], ...]) -> WorkerMemory:
        live, grads, transient, out, inn, flats, resident, saved, waited, carried, computing = state
        params = sum(x.params if not p else x.pack_peak * c for r, c, x, p in zip(resident, computing, st, packed)
                     if r or p)
        act = sum(c * x.stash + t * e for c, t, x, e in zip(live, transient, st, extra))
        # in packs, gradients leave as the backward makes them: one pack's at most, only while it computes
        g = sum((x.pack_max * c if p else x.params) for f, c, x, p in zip(grads, computing, st, packed) if f)
        msgs = sum(o * x.msg_out + i * x.msg_in for o, i, x in zip(out, inn, st))
        sync = preposted + sum(b for f, b in zip(flats, summed) if f) - sum(b for f, b in zip(waited, posted) if f)
        rollback = sum(c for f, c in zip(saved, copies) if f) + sum(c for f, c in zip(carried, carry) if f)
        return WorkerMemory(params, opt, g, act, msgs, sync, rollback)

    if flat is not None and not any(packed):
        # unpacked, every category is linear in the counts (flags are 0 or 1): one dot product per state, the
        # first of the largest priced in full (the same state the loop below keeps)
        params = [x.params for x in st]
        coef = (*(x.stash for x in st), *params, *extra, *(x.msg_out for x in st), *(x.msg_in for x in st), *summed,
                *params, *copies, *(-b for b in posted), *carry)
        totals = [sum(map(mul, f, coef)) for f in flat]
        top = max(totals, default=0)
        if not totals or top + opt + preposted <= 0:
            return WorkerMemory(0, opt, 0, 0, 0, preposted)
        return priced(states[totals.index(top)])
    peak, peak_total = WorkerMemory(0, opt, 0, 0, 0, preposted), 0
    for state in states:
        m = priced(state)
        if m.total > peak_total:
            peak_total, peak = m.total, m
    return peak


def swap_bytes(profile: Profile, schedule: Schedule, stage_layers: Sequence[Sequence[int]],
               offload: Offload | None = None, recompute: bool = False) -> list[int]:
    """Bytes every worker of a schedule lowered with offload moves between host and device in a step: a stage's
    weights per SWAP_IN, its gradients per GRAD_OUT (every parameter of a stage gets a gradient); a stage whose
    weights move in packs (``StageOffload.pack``) moves them all once per micro-batch of every forward and backward,
    twice in a recomputing backward (its forward again, then the backward)."""
    stages = _stages(profile, stage_layers, profile.micro_batch_sizes[0], "sgd", False)
    off = offload or Offload()
    last = len(stage_layers) - 1
    moving = (Kind.SWAP_IN, Kind.GRAD_OUT)

    def moved(a: Action) -> int:
        if a.kind in moving:
            return stages[a.stage].params
        if a.kind.is_compute and off.packed_at(a.stage):
            again = 2 if a.kind is Kind.B and recompute and a.stage < last else 1
            return stages[a.stage].params * a.count * again
        return 0

    return [sum(moved(a) for a in row) for row in schedule.actions]

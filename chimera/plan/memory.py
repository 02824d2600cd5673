"""The memory model: the peak bytes each worker holds for a configuration, from a profile.

A worker holds, for each of its stage replicas (both Chimera replicas), the parameters and the optimizer state
for the whole step, and the gradients from the stage's first backward until the optimizer step. On top come
what its schedule stashes for the backward (walked action by action: a forward stashes one unit per
micro-batch, a backward releases it), the buffers of its messages, and the gradient sum's buffers. The peak is
taken over the worker's action list, so it follows the schedule's order exactly::

    mem = worker_memory(profile, compute_only_schedule, stage_layers, unit=4, optimizer="adamw", recompute=False)
    max(m.total for m in mem)

Per unit and stage: without recomputation the stash is what the stage's layers save for the backward
(``stash_bytes``); with it, the stage's input (and, while one backward recomputes, that unit's full stash).
Gradient sums: a flat copy of the stage's gradients from the sum's start to the optimizer step, and on gloo
for a pair of replicas also the peer's bucket, received into a buffer posted when the step starts.

With offload (a schedule lowered with ``Offload``), for every stage by that stage's policy, the device holds no
optimizer state, gradients only from a backward to their GRAD_OUT (gradient sums then run over host buffers), and,
with weights offloaded, a stage's weights only from its SWAP_IN to its SWAP_OUT; with weights in packs
(``Offload.pack``) only during the stage's own forwards and backwards, at most two consecutive packs at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chimera.profile import Profile
from chimera.schedule import Action, Kind, Offload, Schedule

GiB = 2**30


@dataclass(frozen=True)
class WorkerMemory:
    """Bytes one worker holds at its peak, by category."""

    params: int
    optimizer: int
    grads: int
    activations: int
    messages: int
    sync: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.grads + self.activations + self.messages + self.sync


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


def _stages(profile: Profile, stage_layers: Sequence[Sequence[int]], unit: int, optimizer: str,
            recompute: bool, pack: int = 0) -> list[_Stage]:
    out = []
    last = len(stage_layers) - 1
    for s, layers in enumerate(stage_layers):
        costs = [profile.cost(i, unit) for i in layers]
        full = sum(c.stash_bytes for c in costs) + costs[0].input_bytes
        kept = costs[0].input_bytes if recompute and s < last else full
        params = sum(profile.layers[i].param_bytes for i in layers)
        opt = sum(profile.layers[i].optimizer_bytes.get(optimizer, 0) for i in layers)
        apart = within = opt_within = 0
        for i in layers:
            lp = profile.layers[i]
            for j, nbytes in lp.tied.items():
                if j not in layers:
                    apart += nbytes
                elif j < i:  # both ends here: one parameter, listed in both layers' counts
                    within += nbytes
                    opt_within += lp.optimizer_bytes.get(optimizer, 0) * nbytes // max(1, lp.param_bytes)
        packs = [sum(profile.layers[i].param_bytes for i in layers[j:j + pack])
                 for j in range(0, len(layers), pack)] if pack else []
        peak = max((a + b for a, b in zip(packs, packs[1:])), default=sum(packs))
        out.append(_Stage(params - within, params - within - apart, opt - opt_within, kept, full,
                          costs[0].input_bytes if s > 0 else 0, costs[-1].output_bytes if s < last else 0, peak))
    return out


class MemoryWalk:
    """What a schedule's order implies for memory, whatever the partition: for every worker, the distinct states
    its action list passes through, as counts per stage it holds (units stashed, gradients allocated, a
    recomputation's transient units, messages out and in, a flat gradient copy). Walked once per schedule; a
    partition is then priced by a dot product per state."""

    def __init__(self, schedule: Schedule) -> None:
        self.workers = [self._walk(schedule, w) for w in range(schedule.workers)]

    @staticmethod
    def _walk(schedule: Schedule, w: int) -> tuple[list[int], list[int], list[tuple[tuple[int, ...], ...]]]:
        pairs = schedule.stages_of(w)
        held = [s for _, s in pairs]
        groups = [schedule.stage_group_size(s) for s in held]
        slot = {ps: k for k, ps in enumerate(pairs)}
        n = len(held)
        zero = (0,) * n
        unit: dict[tuple[int, int], tuple[int, ...]] = {}  # (stage slot, count) -> that count at that slot

        def at(k: int, c: int) -> tuple[int, ...]:
            if (k, c) not in unit:
                unit[(k, c)] = tuple(c if i == k else 0 for i in range(n))
            return unit[(k, c)]

        def put(vec: tuple[int, ...], k: int, v: int) -> tuple[int, ...]:
            return tuple(v if i == k else x for i, x in enumerate(vec))

        live = [0] * n
        grads, flats = zero, zero
        row = schedule.actions[w]
        evicted = {(a.pipe, a.stage) for a in row if a.kind is Kind.SWAP_OUT}  # weights offloaded: start off device
        resident = tuple(int(ps not in evicted) for ps in pairs)
        states: set[tuple[tuple[int, ...], ...]] = set()
        for a in row:
            kind = a.kind
            if kind is Kind.F:  # its output waits to be sent (its received input is now part of the stash)
                k = slot[(a.pipe, a.stage)]
                live[k] += a.count
                states.add((tuple(live), grads, zero, at(k, a.count), zero, flats, resident, at(k, 1)))
            elif kind in (Kind.B, Kind.I):  # the output gradient in, the input gradient out; recomputing, a transient
                k = slot[(a.pipe, a.stage)]
                grads = put(grads, k, 1)
                c = at(k, a.count)
                states.add((tuple(live), grads, c, c, c, flats, resident, at(k, 1)))
                if kind is Kind.B:
                    live[k] -= a.count
            elif kind is Kind.W:  # a split backward's stash lives until its weight gradients are made
                live[slot[(a.pipe, a.stage)]] -= a.count
            elif kind is Kind.ALLREDUCE_START:
                k = slot[(a.pipe, a.stage)]
                flats = put(flats, k, 1)
                states.add((tuple(live), grads, zero, zero, zero, flats, resident, zero))
            elif kind is Kind.SWAP_IN:
                resident = put(resident, slot[(a.pipe, a.stage)], 1)
                states.add((tuple(live), grads, zero, zero, zero, flats, resident, zero))
            elif kind is Kind.SWAP_OUT:
                resident = put(resident, slot[(a.pipe, a.stage)], 0)
            elif kind is Kind.GRAD_OUT:
                grads = put(grads, slot[(a.pipe, a.stage)], 0)
        if not schedule.lowered:  # the step's end: every stage's gradient sum started (a lowered list says when)
            states.add((tuple(live), grads, zero, zero, zero, tuple(int(g > 1) for g in groups), resident, zero))
        return held, groups, _maximal(states)


def _maximal(states: set[tuple[tuple[int, ...], ...]]) -> list[tuple[tuple[int, ...], ...]]:
    """The states no other state dominates (every count at least as large): only those can be the peak. States
    that differ only in their stash counts are compared on those alone."""
    groups: dict[tuple[tuple[int, ...], ...], list[tuple[int, ...]]] = {}
    for live, *rest in states:
        groups.setdefault(tuple(rest), []).append(live)
    keep = []
    for rest, lives in groups.items():
        front: list[tuple[int, ...]] = []
        for live in sorted(lives, key=sum, reverse=True):
            if not any(all(a >= b for a, b in zip(f, live)) for f in front):
                front.append(live)
        keep += [(live, *rest) for live in front]
    return keep


def worker_memory(profile: Profile, schedule: Schedule, stage_layers: Sequence[Sequence[int]], unit: int,
                  optimizer: str, recompute: bool, exchange: bool = True, walk: MemoryWalk | None = None,
                  offload: Offload | None = None) -> list[WorkerMemory]:
    """Peak bytes of every worker of one data-parallel group (module docstring).

    ``schedule``: compute-only or lowered (``walk``: its :class:`MemoryWalk`, when already made); ``exchange``:
    gloo, where a pair of replicas sums gradients by exchanging buckets (the peer's bucket lands in a buffer
    posted at the step's start); ``offload``: the policy the schedule was lowered with.
    """
    off = offload or Offload()
    stages = _stages(profile, stage_layers, unit, optimizer, recompute, off.pack)
    walk = walk or MemoryWalk(schedule)
    return [_worker(held, groups, states, stages, exchange, off) for held, groups, states in walk.workers]


def _worker(held: list[int], groups: list[int], states: set[tuple[tuple[int, ...], ...]], stages: list[_Stage],
            exchange: bool, offload: Offload) -> WorkerMemory:
    st = [stages[s] for s in held]
    opt = sum(x.optimizer for s, x in zip(held, st) if not offload.optimizer_at(s))
    # offloaded gradients are summed over host buffers: no device buffers for that stage's sum
    device_sync = [not offload.gradients_at(s) for s in held]
    preposted = sum(x.bucket for x, n, d in zip(st, groups, device_sync) if exchange and n == 2 and d)
    extra = [x.full_stash if x.stash != x.full_stash else 0 for x in st]  # a recomputing backward's transient
    peak, peak_total = WorkerMemory(0, opt, 0, 0, 0, preposted), 0
    packed = [offload.packed_at(s) for s in held]
    for live, grads, transient, out, inn, flats, resident, computing in states:
        params = sum(x.params if not p else x.pack_peak * c for r, c, x, p in zip(resident, computing, st, packed)
                     if r or p)
        act = sum(c * x.stash + t * e for c, t, x, e in zip(live, transient, st, extra))
        g = sum(x.params for f, x in zip(grads, st) if f)
        msgs = sum(o * x.msg_out + i * x.msg_in for o, i, x in zip(out, inn, st))
        sync = preposted + sum(x.bucket for f, x, n, d in zip(flats, st, groups, device_sync) if f and n > 1 and d)
        total = params + opt + g + act + msgs + sync
        if total > peak_total:
            peak_total, peak = total, WorkerMemory(params, opt, g, act, msgs, sync)
    return peak


def swap_bytes(profile: Profile, schedule: Schedule, stage_layers: Sequence[Sequence[int]],
               offload: Offload | None = None, recompute: bool = False) -> list[int]:
    """Bytes every worker of a schedule lowered with offload moves between host and device in a step: a stage's
    weights per SWAP_IN, its gradients per GRAD_OUT (every parameter of a stage gets a gradient); a stage whose
    weights move in packs (``offload.pack``) moves them all once per micro-batch of every forward and backward,
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


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"512MiB"``, ``"1.5e9"`` or ``"4GB"`` -> bytes; ValueError says the accepted forms."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1, "": 1}
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    if unit not in units:
        raise ValueError(f"cannot read {text!r} as bytes; write e.g. 80GiB, 512MiB, 4GB or 1.5e9")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as bytes; write e.g. 80GiB, 512MiB, 4GB or 1.5e9") from None
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value * units[unit])

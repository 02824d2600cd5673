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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chimera.profile import Profile
from chimera.schedule import Kind, Schedule

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


def _stages(profile: Profile, stage_layers: Sequence[Sequence[int]], unit: int, optimizer: str,
            recompute: bool) -> list[_Stage]:
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
        out.append(_Stage(params - within, params - within - apart, opt - opt_within, kept, full,
                          costs[0].input_bytes if s > 0 else 0, costs[-1].output_bytes if s < last else 0))
    return out


def worker_memory(profile: Profile, schedule: Schedule, stage_layers: Sequence[Sequence[int]], unit: int,
                  optimizer: str, recompute: bool, exchange: bool = True) -> list[WorkerMemory]:
    """Peak bytes of every worker of one data-parallel group (module docstring).

    ``schedule``: compute-only or lowered; ``exchange``: gloo, where a pair of replicas sums gradients by
    exchanging buckets (the peer's bucket lands in a buffer posted at the step's start).
    """
    stages = _stages(profile, stage_layers, unit, optimizer, recompute)
    return [_worker(schedule, w, stages, recompute, exchange) for w in range(schedule.workers)]


def _worker(schedule: Schedule, w: int, stages: list[_Stage], recompute: bool, exchange: bool) -> WorkerMemory:
    held = schedule.stages_of(w)
    params = sum(stages[s].params for _, s in held)
    opt = sum(stages[s].optimizer for _, s in held)
    synced = [s for _, s in held if len(schedule.stage_group(s)) > 1]
    preposted = sum(stages[s].bucket for s in synced if exchange and len(schedule.stage_group(s)) == 2)
    grads_of: set[tuple[str, int]] = set()
    flats = 0
    live = peak_total = 0
    peak = WorkerMemory(params, opt, 0, 0, 0, preposted)
    for a in schedule.actions[w]:
        st = stages[a.stage] if a.kind is not Kind.OPTIMIZER_STEP else None
        transient = msgs = 0
        if a.kind is Kind.F:  # its output waits to be sent (its received input is now part of the stash)
            assert st is not None
            live += a.count * st.stash
            msgs = a.count * st.msg_out
        elif a.kind is Kind.B:
            assert st is not None
            grads_of.add((a.pipe, a.stage))
            if recompute and st.stash != st.full_stash:
                transient = a.count * st.full_stash
            msgs = a.count * (st.msg_in + st.msg_out)  # the output gradient in, the input gradient out
        elif a.kind is Kind.ALLREDUCE_START:
            assert st is not None
            flats += st.bucket
        grads = sum(stages[s].params for _, s in grads_of)
        act = live + transient
        total = params + opt + grads + act + msgs + preposted + flats
        if total > peak_total:
            peak_total = total
            peak = WorkerMemory(params, opt, grads, act, msgs, preposted + flats)
        if a.kind is Kind.B:
            assert st is not None
            live -= a.count * st.stash
    return peak


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

"""Does a configuration fit a worker's memory? The memory model (:mod:`chimera.plan.memory`) applied to a
schedule and a partition, choosing the least offload that fits.

    peaks = estimate_peaks(chain, schedule, stage_layers, unit=4, optimizer="adamw", recompute=False)
    off, lowered, mem = fit_offload(profile, schedule, stage_layers, 4, "adamw", False, budget=2**30)
    available_memory("cpu", workers=4)      # (bytes, where from): what a worker may use when no budget is given

Per-layer bytes come from a profile, or from the chain's shapes on the meta device (:func:`chimera.profile.shapes.
shapes_profile`), which allocates nothing, so any micro-batch size is priced in well under a second.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from chimera.offload.lowering import lower
from chimera.offload.policy import Level, Offload, ladder
from chimera.plan.memory import WorkerMemory, worker_memory
from chimera.profile import Profile
from chimera.schedule import Schedule
from chimera.util.units import GiB


class OverBudget(ValueError):
    """No offload policy tried fits the budget; ``least``: the fewest bytes any of them needs at its peak worker."""

    def __init__(self, message: str, least: int) -> None:
        super().__init__(message)
        self.least = least


def estimate_peaks(chain: Any, schedule: Schedule, stage_layers: Sequence[Sequence[int]], unit: int, optimizer: str,
                   recompute: bool, exchange: bool = True, offload: Offload | None = None) -> list[WorkerMemory]:
    """The memory model's peak per worker of one data-parallel group, from the chain's shapes."""
    from chimera.profile.shapes import shapes_profile  # imports torch: not needed to plan from a profile

    return worker_memory(shapes_profile(chain, unit), schedule, stage_layers, unit, optimizer, recompute, exchange,
                         offload=offload)


def available_memory(device: str, workers: int) -> tuple[int, str] | None:
    """(bytes, where from) one worker may use when no budget is given: the free memory of the visible GPU, or this
    machine's available memory shared by ``workers`` workers; None when unknown (no GPU visible)."""
    if device == "cuda":
        import torch  # only here: planning from a profile needs no torch (its import is a second of the plan's time)

        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info()
        return free, "free memory of this machine's GPU"
    avail = psutil.virtual_memory().available
    return avail // max(1, workers), f"{avail / GiB:.1f} GiB available on this machine / {workers} workers"


def fit_offload(profile: Profile, schedule: Schedule, stage_layers: Sequence[Sequence[int]], unit: int,
                optimizer: str, recompute: bool, budget: int, offloads: Sequence[Offload] | None = None,
                exchange: bool = True, per_stage: bool = False,
                optimizer_owned: Sequence[Mapping[int, int]] | None = None, post_validated: bool = False
                ) -> tuple[Offload, Schedule, list[WorkerMemory]]:
    """The first of ``offloads`` (least offload first; default: every level of the ladder for every stage) whose
    every worker fits ``budget`` bytes, the compute-only ``schedule`` lowered with it, and the workers' peaks;
    :class:`OverBudget` naming the bytes needed against the budget and what to change when none fits. ``per_stage``: then
    the least offload per stage that fits (each worker by the policies of the stages it holds, none above the
    first uniform policy that fits; see :func:`_least_per_stage`). ``optimizer_owned``: the sharded optimizer
    state's shares (:func:`worker_memory`; not with ``per_stage``). ``post_validated``: lowered with post-validated
    steps (:func:`chimera.offload.lowering.lower`), whose rollback copies count; no offload then moves the
    optimizer state."""
    offloads = list(offloads) if offloads is not None else [Offload.uniform(lv) for lv in ladder()]
    tried, least = [], None
    for k, off in enumerate(offloads):
        lowered = lower(schedule, off, post_validated)
        mem = worker_memory(profile, lowered, stage_layers, unit, optimizer, recompute, exchange, offload=off,
                            optimizer_owned=optimizer_owned)
        w = max(range(len(mem)), key=lambda i: mem[i].total)
        if mem[w].total <= budget:
            if per_stage and k > 0 and all(o.uniform_level for o in offloads[:k + 1]):
                first = off.stages[0]  # the levels up to the one that fits, with its prefetch and packs
                levels = list(dict.fromkeys(o.stages[0].level for o in offloads[:k + 1]))
                return _least_per_stage(profile, schedule, stage_layers, unit, optimizer, recompute, budget,
                                        levels, first.prefetch, exchange, first.pack)
            return off, lowered, mem
        m = mem[w]
        least = m.total if least is None else min(least, m.total)
        tried.append(f"--offload {off.describe()}: {m.total} bytes ({m.total / 2**20:.1f} MiB) on worker {w}: parameters "
                     f"{m.params}, optimizer state {m.optimizer}, gradients {m.grads}, activations {m.activations}, "
                     f"messages {m.messages}, gradient sums {m.sync}" +
                     (f", rollback copies {m.rollback}" if m.rollback else ""))
    last = offloads[-1]
    more = [lv for lv in ladder() if lv.amount > max(s.level.amount for s in last.stages)]
    if post_validated:  # no offload combines with it: levers() names it
        hint = ""
    elif more:
        hint = f"--offload {more[-1].name} or auto, "
    else:
        hint = ("a smaller --offload-pack, " if any(s.pack for s in last.stages)
                else "--offload-pack 1 (weights in packs of layers), ")
    raise OverBudget(f"the configuration needs more than the budget of {budget} bytes ({budget / 2**20:.1f} MiB) per "
                     f"worker: {'; '.join(tried)}. Change: {hint}more stages (--stages), "
                     f"{''.join(f'{x}, ' for x in levers(m, recompute, post_validated, last))}or a larger "
                     "--memory-per-worker", least or 0)


def levers(peak: WorkerMemory, recompute: bool, post_validated: bool = False, offload: Offload | None = None
           ) -> list[str]:
    """The flags that lower ``peak`` besides more stages and more memory, only those that act on what it holds:
    no --post-validate where its rollback copies count, recomputation and a smaller micro-batch where it holds
    activations or messages, a smaller prefetch where ``offload`` moves whole stages' weights ahead of use."""
    return [*(["no --post-validate (it keeps a copy of every stage's weights and optimizer state, and the step's "
               "gradients, from the stage's update to the next step's first update, and no offload combines with "
               "it)"] if post_validated and peak.rollback
              else []),
            *(["--recompute"] if peak.activations and not recompute else []),
            *(["a smaller --micro-batch-size"] if peak.activations or peak.messages else []),
            *(["a smaller --prefetch"] if offload is not None and offload.weights
              and any(x.prefetch for x in offload.stages) else [])]


def _least_per_stage(profile: Profile, schedule: Schedule, stage_layers: Sequence[Sequence[int]], unit: int,
                     optimizer: str, recompute: bool, budget: int, policies: Sequence[Level], prefetch: int,
                     exchange: bool, pack: int = 0) -> tuple[Offload, Schedule, list[WorkerMemory]]:
    """The least per-stage offload that fits, given that ``policies[-1]`` for every stage fits.

    A worker's memory depends only on the policies of the stages it holds, so stages are grouped by the workers
    that share them (a Chimera worker holds stage i and D-1-i) and every group takes the first combination that
    fits its workers, in order of total offload, the heaviest stages offloaded first among equals. Groups are
    priced together (one lowering per round), and a group of more than three stages tries uniform levels only,
    so the search takes at most ``len(policies) ** 3`` rounds."""
    d = schedule.stages
    parent = list(range(d))

    def root(s: int) -> int:
        while parent[s] != s:
            s = parent[s]
        return s

    holders = [[s for _, s in schedule.stages_of(w)] for w in range(schedule.workers)]
    for held in holders:
        for s in held[1:]:
            parent[root(s)] = root(held[0])
    groups = [[s for s in range(d) if root(s) == r] for r in sorted({root(s) for s in range(d)})]
    weight = [sum(profile.layers[i].param_bytes for i in layers) for layers in stage_layers]
    top = len(policies) - 1
    orders = []
    for g in groups:
        heavy = sorted(g, key=lambda s: -weight[s])
        combos = (itertools.product(range(top + 1), repeat=len(g)) if len(g) <= 3
                  else ((k,) * len(g) for k in range(top + 1)))
        orders.append(sorted((dict(zip(g, c)) for c in combos),
                             key=lambda c: (sum(c.values()), [-c[s] for s in heavy])))
    chosen: dict[int, dict[int, int]] = {}
    for j in range(max(len(o) for o in orders)):
        levels = {s: lv for gi, o in enumerate(orders) for s, lv in chosen.get(gi, o[min(j, len(o) - 1)]).items()}
        off = Offload.of([policies[levels[s]] for s in range(d)], prefetch, pack)
        lowered = lower(schedule, off)
        mem = worker_memory(profile, lowered, stage_layers, unit, optimizer, recompute, exchange, offload=off)
        for gi, g in enumerate(groups):
            if gi not in chosen and all(mem[w].total <= budget for w, held in enumerate(holders) if held[0] in g):
                chosen[gi] = {s: levels[s] for s in g}
        if len(chosen) == len(groups):
            uniform = off.uniform_level
            return (Offload.uniform(off.stages[0].level, prefetch, pack) if uniform else off), lowered, mem
    raise AssertionError("the uniform policy fits, so every group fits by its last combination")  # pragma: no cover

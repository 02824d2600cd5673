"""The planned partition: layers split into stages to minimise the simulated step time under a memory limit.

Each worker runs the stages it holds: one in GPipe/1F1B, stages w, w+D, ... under interleaving, and stage i of
the down pipe with stage D-1-i of the up pipe in Chimera, so a balanced Chimera partition balances the pair,
not the stage. The search:

1. the contiguous split minimising the largest stage's compute (dynamic programming over the layers);
2. hill climbing on the largest *worker* load (a boundary moves by one layer while that lowers it);
3. hill climbing on the simulated step time, refusing moves that break the memory limit.

    sizes, pred = plan_partition(profile, schedule, unit=4, recompute=False, optimizer="adamw")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from chimera.plan.costs import simulator_costs
from chimera.plan.memory import MemoryWalk, WorkerMemory, worker_memory
from chimera.profile import Profile
from chimera.schedule import Offload, Schedule, lower, simulate
from chimera.splits import layers_of, min_max_split


@dataclass(frozen=True)
class PartitionResult:
    """A partition (layers per stage), its simulated step, and each worker's peak memory."""

    sizes: list[int]
    step_s: float
    bubble: float
    memory: list[WorkerMemory]

    @property
    def peak_memory(self) -> int:
        return max(m.total for m in self.memory)


def _neighbours(sizes: list[int]) -> list[list[int]]:
    """Partitions one layer away: a boundary between two stages moves by one layer."""
    out = []
    for b in range(len(sizes) - 1):
        for d in (-1, 1):
            new = list(sizes)
            new[b] += d
            new[b + 1] -= d
            if new[b] >= 1 and new[b + 1] >= 1:
                out.append(new)
    return out


def _climb(sizes: list[int], score: Callable[[list[int]], tuple[float, ...]], limit: int) -> list[int]:
    """Steepest descent on ``score`` over one-layer moves, at most ``limit`` rounds."""
    current = score(sizes)
    for _ in range(limit):
        best = min(((score(n), n) for n in _neighbours(sizes)), default=None)
        if best is None or best[0] >= current:
            break
        current, sizes = best
    return sizes


def plan_partition(profile: Profile, schedule: Schedule, unit: int, recompute: bool, optimizer: str,
                   memory_limit: int | None = None, exchange: bool = True, rounds: int = 8,
                   simulated_up_to: int = 16, exact: bool = True, offload: Offload | None = None) -> PartitionResult:
    """The partition of ``profile``'s layers into ``schedule.stages`` stages with the least simulated step time
    whose every worker fits ``memory_limit`` bytes (when no partition fits, the one that needs least memory).

    Step 3 (``rounds`` of moves scored by simulation) runs up to ``simulated_up_to`` stages; deeper pipelines
    keep the load-balanced partition, whose step the simulator then predicts once. ``exact``: simulate the
    lowered schedule (messages as actions, gradient sums, optimizer); otherwise, for a quick first ranking, the
    compute-only schedule (messages as delays) plus the largest stage's gradient sum, which the step's end waits
    for. ``offload``: the schedule is lowered with its swaps (always: they decide memory) and priced with them."""
    n_layers, d = len(profile.layers), schedule.stages
    per_layer = [profile.stage_seconds([i], unit) for i in range(n_layers)]
    work = [t["forward"] + t["backward"] + (t["recompute"] if recompute else 0.0) for t in per_layer]
    holders = [[s for _, s in schedule.stages_of(w)] for w in range(schedule.workers)]
    compute_only = schedule.compute_only()
    offloaded = offload is not None and offload.optimizer
    exact = exact or offloaded
    timed = lower(compute_only, offload) if exact else compute_only  # prepared once, simulated per partition
    walk = MemoryWalk(timed)

    def load(sizes: list[int]) -> tuple[float, ...]:
        starts = [sum(sizes[:s]) for s in range(d)]
        stage = [sum(work[starts[s]:starts[s] + sizes[s]]) for s in range(d)]
        return (max(sum(stage[s] for s in held) for held in holders),)

    def evaluate(sizes: list[int]) -> PartitionResult:
        layers = layers_of(sizes)
        mem = worker_memory(profile, timed, layers, unit, optimizer, recompute, exchange, walk, offload)
        costs = simulator_costs(profile, layers, unit, recompute, schedule, optimizer, offload)
        sim = simulate(timed, costs)
        tail = 0.0 if exact else max((costs.stage_value(costs.allreduce, s) for s in range(d)), default=0.0)
        return PartitionResult(list(sizes), float(sim.makespan) + tail, float(sim.bubble), mem)

    cache: dict[tuple[int, ...], PartitionResult] = {}

    def simulated(sizes: list[int]) -> tuple[float, ...]:
        key = tuple(sizes)
        if key not in cache:
            cache[key] = evaluate(sizes)
        r = cache[key]
        over = max(0, r.peak_memory - memory_limit) if memory_limit is not None else 0
        return (float(over), r.step_s)

    sizes = _climb(min_max_split(work, d), load, limit=4 * d)
    if d <= simulated_up_to:
        start, sizes = sizes, _climb(sizes, simulated, limit=rounds)
        if simulated(sizes)[0] > 0:  # stuck over the limit: the fastest path may pass partitions over it to one under
            sizes = min(sizes, _climb(start, lambda s: simulated(s)[1:], limit=rounds), key=simulated)
    return cache[tuple(sizes)] if tuple(sizes) in cache else evaluate(sizes)

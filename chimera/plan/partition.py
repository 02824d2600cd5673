"""Partitioning, in one place: the split of a chain's layers into ``D`` consecutive, non-empty stages.

Fixed methods (:func:`partition`, no profile needed):

- ``"uniform"``: balance the inner layers (a transformer's blocks). The ``L`` layers between the first and the
  last are spread as evenly as possible over the ``D`` stages; the first layer (embeddings) joins stage 0 and
  the last (head) joins stage ``D-1``. When they do not divide evenly, the extra layers go to the middle
  stages first, then to stage 0, and to the last stage only as a last resort, because the first and last
  stages already carry the embeddings and the (large, vocabulary-sized) head. With ``D > L`` the first and
  then the last layer get stages of their own.
- ``"params"``: contiguous split that minimises the largest per-stage parameter count (a tied weight
  counts in each stage that stores a copy).
- explicit: a list of ``D`` stage sizes (layers per stage, summing to ``num_layers``), a list of ``D+1``
  boundaries ``[0, b1, ..., num_layers]``, or the same as a comma-separated string (``"3,3,2"``).

The planned partition (:func:`plan_partition`, ``--partition planned``): layers split to minimise the simulated
step time under a memory limit. Each worker runs the stages it holds: one in GPipe/1F1B, stages w, w+D, ... under
interleaving, and stage i of the down pipe with stage D-1-i of the up pipe in Chimera, so a balanced Chimera
partition balances the pair, not the stage. The search:

1. the contiguous split minimising the largest stage's compute (dynamic programming over the layers);
2. hill climbing on the largest *worker* load (a boundary moves by one layer while that lowers it);
3. hill climbing on the simulated step time, refusing moves that break the memory limit;
4. still over the limit (a local search can miss a fitting partition far from the balanced one): every partition
   priced by the memory model alone where there are at most ``ENUMERATED`` of them (the most compute-balanced that
   fits starts a last climb of step 3; none fits: the one needing least memory), else a descent on memory.

    partition(chain, 4, "uniform")                       # [[0, 1], [2], [3], [4, 5]]
    sizes, pred = plan_partition(profile, schedule, unit=4, recompute=False, optimizer="adamw")
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from chimera.offload.lowering import lower
from chimera.offload.policy import Offload
from chimera.plan.costs import simulator_costs
from chimera.plan.memory import MemoryWalk, WorkerMemory, worker_memory
from chimera.plan.sharding import Owned
from chimera.profile import Profile
from chimera.schedule import Schedule, simulate


def min_max_split(counts: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of ``counts`` into ``stages`` non-empty parts minimising the maximum part sum (part sizes).

    The ``"params"`` method splits parameter counts with it; the planner splits measured compute."""
    return list(_min_max_split(tuple(counts), stages))


@lru_cache(maxsize=1024)
def _min_max_split(counts: tuple[float, ...], stages: int) -> tuple[int, ...]:
    n = len(counts)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-sum splitting the first i layers into k stages; arg for reconstruction
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], arg[k][i] = cost, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        j = arg[k][i]
        sizes.append(i - j)
        i = j
    return tuple(sizes[::-1])


def layers_of(sizes: Sequence[int]) -> list[list[int]]:
    """Stage -> consecutive layer indices, for stage sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def _check_stages(model: Any, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"the number of stages must be >= 1, got D={stages}; use --stages >= 1")
    if stages > model.num_layers:
        raise ValueError(
            f"D={stages} is larger than the {model.num_layers} layers of {model.name}; "
            f"use --stages <= {model.num_layers} or a deeper model"
        )


def _uniform_sizes(num_blocks: int, stages: int) -> list[int]:
    """Layers per stage for the ``"uniform"`` method (see module docstring)."""
    if stages == 1:
        return [num_blocks + 2]
    if stages > num_blocks:  # one block per stage; embeddings, then head, get their own stage
        blocks = [1] * num_blocks
        if stages == num_blocks + 1:  # head alone: it is the heavier of the two ends
            return [2, *blocks[1:], 1]
        return [1, *blocks, 1]
    base, extra = divmod(num_blocks, stages)
    blocks = [base] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1]
    for s in order[:extra]:
        blocks[s] += 1
    blocks[0] += 1
    blocks[-1] += 1
    return blocks


def _explicit(model: Any, stages: int, spec: Sequence[int]) -> list[int]:
    spec = [int(x) for x in spec]
    n = model.num_layers
    hint = (
        f"give {stages} stage sizes summing to {n} (e.g. {_uniform_sizes(model.num_layers - 2, stages)}) "
        f"or {stages + 1} boundaries from 0 to {n}"
    )
    if len(spec) == stages:
        if any(s < 1 for s in spec) or sum(spec) != n:
            raise ValueError(
                f"stage sizes {spec} must be >= 1 and sum to the {n} layers of {model.name}; {hint}"
            )
        return spec
    if len(spec) == stages + 1:
        ok = spec[0] == 0 and spec[-1] == n and all(a < b for a, b in zip(spec, spec[1:]))
        if not ok:
            raise ValueError(
                f"boundaries {spec} must rise strictly from 0 to {n} ({model.name} has {n} layers); {hint}"
            )
        return [b - a for a, b in zip(spec, spec[1:])]
    raise ValueError(f"explicit partition {spec} has {len(spec)} entries for D={stages}; {hint}")


def partition(model: Any, stages: int, method: str | Sequence[int] = "uniform") -> list[list[int]]:
    """Layer indices of each of the ``stages`` stages (consecutive, covering all layers, non-empty)."""
    _check_stages(model, stages)
    if isinstance(method, str):
        if method == "uniform":
            sizes = _uniform_sizes(model.num_layers - 2, stages)
        elif method == "params":
            sizes = min_max_split(model.layer_num_params(), stages)
        elif method.replace(",", "").replace(" ", "").isdigit():
            sizes = _explicit(model, stages, [int(x) for x in method.split(",") if x.strip()])
        else:
            raise ValueError(
                f"unknown partition method {method!r}; use 'uniform', 'params', "
                "a list of stage sizes or boundaries, or a comma-separated string of them"
            )
    else:
        sizes = _explicit(model, stages, method)
    return layers_of(sizes)


@dataclass(frozen=True)
class PartitionResult:
    """A partition (layers per stage), its simulated step, and each worker's peak memory."""

    sizes: list[int]
    step_s: float
    bubble: float
    memory: list[WorkerMemory]

    @property
    def peak_memory(self) -> int:
        return max((m.total for m in self.memory), default=0)


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


#: step 4 prices every partition by memory where there are at most this many (C(L - 1, D - 1) of L layers)
ENUMERATED = 4096


def _all_sizes(layers: int, stages: int) -> Iterator[list[int]]:
    """Every split of ``layers`` consecutive layers into ``stages`` non-empty stages (stage sizes)."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = [0, *cuts, layers]
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _climb(sizes: list[int], score: Callable[[list[int]], tuple[float, ...]], limit: int) -> list[int]:
    """Steepest descent on ``score`` over one-layer moves, at most ``limit`` rounds."""
    current = score(sizes)
    for _ in range(limit):
        best = min(((score(n), n) for n in _neighbours(sizes)), default=None)
        if best is None or best[0] >= current:
            break
        current, sizes = best
    return sizes


def _least_over(sizes: list[int], peak: Callable[[list[int]], int], load: Callable[[list[int]], tuple[float, ...]],
                limit: int) -> list[int]:
    """Step 4 (module docstring): the most balanced (``load``) partition whose ``peak`` fits ``limit``, else the one
    of least peak; exact up to ``ENUMERATED`` partitions, beyond that a descent on memory from ``sizes``."""
    n, d = sum(sizes), len(sizes)
    if math.comb(n - 1, d - 1) > ENUMERATED:
        return _climb(sizes, lambda s: (peak(s), *load(s)), limit=n * d)
    priced = [(peak(s), s) for s in _all_sizes(n, d)]
    fits = [s for p, s in priced if p <= limit]
    return min(fits, key=load) if fits else min(priced)[1]


def layer_work(profile: Profile, unit: int, recompute: bool) -> tuple[float, ...]:
    """Seconds of every layer's forward and backward (and recomputation) at ``unit`` samples."""
    key = (id(profile), unit, recompute)
    hit = _WORK.get(key)
    if hit is None or hit[0] is not profile:  # the entry keeps its profile alive: no other can take its id
        per_layer = [profile.stage_seconds([i], unit) for i in range(len(profile.layers))]
        hit = _WORK[key] = (profile, tuple(t["forward"] + t["backward"] + (t["recompute"] if recompute else 0.0)
                                           for t in per_layer))
        while len(_WORK) > 64:
            del _WORK[next(iter(_WORK))]
    return hit[1]


_WORK: dict[tuple[int, int, bool], tuple[Profile, tuple[float, ...]]] = {}


def balanced(profile: Profile, schedule: Schedule, unit: int, recompute: bool) -> list[int]:
    """The load-balanced partition (steps 1 and 2 of the search) of ``profile``'s layers over ``schedule``'s stages:
    what the planner's first pass prices and its refinement starts from. Reads only the schedule's placement."""
    return list(_balanced(layer_work(profile, unit, recompute), schedule.stages, _holders(schedule)))


def _holders(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per worker, the stages it holds."""
    return tuple(tuple(s for _, s in schedule.stages_of(w)) for w in range(schedule.workers))


def _load(work: Sequence[float], d: int, holders: tuple[tuple[int, ...], ...]
          ) -> Callable[[list[int]], tuple[float, ...]]:
    """The largest worker load of a partition (stage sizes) of layers of ``work`` seconds over ``d`` stages."""
    def load(sizes: list[int]) -> tuple[float, ...]:
        starts = [sum(sizes[:s]) for s in range(d)]
        stage = [sum(work[starts[s]:starts[s] + sizes[s]]) for s in range(d)]
        return (max(sum(stage[s] for s in held) for held in holders),)

    return load


@lru_cache(maxsize=1024)
def _balanced(work: tuple[float, ...], d: int, holders: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    return tuple(_climb(min_max_split(work, d), _load(work, d, holders), limit=4 * d))


def with_memory(part: PartitionResult, profile: Profile, schedule: Schedule, unit: int, recompute: bool,
                optimizer: str, exchange: bool = True, offload: Offload | None = None, owned: Owned | None = None,
                post_validated: bool = False) -> PartitionResult:
    """``part``, a first estimate of :func:`plan_partition` made without its memory (``memory=False``), with every
    worker's peak priced as that estimate would have priced it (on the compute-only schedule, or
    ``post_validated`` on the post-validated lowering)."""
    layers = layers_of(part.sizes)
    own = owned(schedule, layers) if owned is not None else None
    walked = lower(schedule.compute_only(), offload, True) if post_validated else schedule.compute_only()
    mem = worker_memory(profile, walked, layers, unit, optimizer, recompute, exchange, None, offload, own)
    return PartitionResult(part.sizes, part.step_s, part.bubble, mem)


def plan_partition(profile: Profile, schedule: Schedule, unit: int, recompute: bool, optimizer: str,
                   memory_limit: int | None = None, exchange: bool = True, rounds: int = 8,
                   simulated_up_to: int = 16, exact: bool = True, offload: Offload | None = None,
                   owned: Owned | None = None, memory: bool = True, clip: bool = False,
                   post_validated: bool = False) -> PartitionResult:
    """The partition of ``profile``'s layers into ``schedule.stages`` stages with the least simulated step time
    whose every worker fits ``memory_limit`` bytes (when no partition fits, the one that needs least memory; both
    exact up to ``ENUMERATED`` partitions with ``rounds`` > 0, beyond that a local search's best).

    Step 3 (``rounds`` of moves scored by simulation) runs up to ``simulated_up_to`` stages; deeper pipelines
    keep the load-balanced partition, whose step the simulator then predicts once. ``exact``: simulate the
    lowered schedule (messages as actions, gradient sums, optimizer); otherwise, for a quick first ranking, the
    compute-only schedule (messages as delays) plus the largest stage's gradient sum and the optimizer step, which
    the step's end waits for. ``offload``: the schedule is lowered with its swaps (always: they decide memory) and
    priced with them.
    ``owned`` (``--shard-optimizer``): each partition's memory counts only every worker's owned share of the
    optimizer state (:data:`chimera.plan.sharding.Owned`; its ValueError, where a partition cannot be sharded,
    propagates). ``memory`` False (a first estimate, ``rounds`` 0, of a candidate that surely fits): the step alone,
    ``PartitionResult.memory`` empty (the memory walk is what it saves). ``clip``: the optimizer step clips by the
    global gradient norm (training's ``--clip-grad`` > 0; :func:`chimera.plan.costs.simulator_costs`).
    ``post_validated`` (``--post-validate``): memory is walked on the post-validated lowering (its rollback copies
    counted); the step is still simulated on the drained lowering, whose optimizer step the simulator prices (a
    post-validated step ends with the same global check: it drains alike)."""
    d = schedule.stages
    compute_only = schedule.compute_only()
    offloaded = offload is not None and offload.optimizer
    exact = exact or offloaded
    timed = lower(compute_only, offload) if exact else compute_only  # prepared once, simulated per partition
    walked = lower(compute_only, offload, True) if post_validated else timed
    walks: list[MemoryWalk] = []

    def walker() -> MemoryWalk:  # walked once, when first asked for
        if not walks:
            walks.append(MemoryWalk(walked))
        return walks[0]

    def evaluate(sizes: list[int]) -> PartitionResult:
        layers = layers_of(sizes)
        own = owned(schedule, layers) if owned is not None else None
        costs = simulator_costs(profile, layers, unit, recompute, schedule, optimizer, offload, clip)
        sim = simulate(timed, costs)
        tail = 0.0 if exact else costs.optimizer + max((costs.stage_value(costs.allreduce, s) for s in range(d)),
                                                       default=0.0)
        step = float(sim.makespan) + tail
        if not memory:
            return PartitionResult(list(sizes), step, float(sim.bubble), [])
        mem = worker_memory(profile, walked, layers, unit, optimizer, recompute, exchange, walker(), offload, own)
        return PartitionResult(list(sizes), step, float(sim.bubble), mem)

    cache: dict[tuple[int, ...], PartitionResult] = {}

    def simulated(sizes: list[int]) -> tuple[float, ...]:
        key = tuple(sizes)
        if key not in cache:
            cache[key] = evaluate(sizes)
        r = cache[key]
        over = max(0, r.peak_memory - memory_limit) if memory_limit is not None else 0
        return (float(over), r.step_s)

    sizes = balanced(profile, schedule, unit, recompute)
    if d <= simulated_up_to:
        start, sizes = sizes, _climb(sizes, simulated, limit=rounds)
        if simulated(sizes)[0] > 0:  # stuck over the limit: the fastest path may pass partitions over it to one under
            sizes = min(sizes, _climb(start, lambda s: simulated(s)[1:], limit=rounds), key=simulated)
        if rounds > 0 and memory_limit is not None and simulated(sizes)[0] > 0:  # step 4
            def peak(s: list[int]) -> int:  # the memory model alone, no simulation
                layers = layers_of(s)
                own = owned(schedule, layers) if owned is not None else None
                return max(m.total for m in worker_memory(profile, walked, layers, unit, optimizer, recompute,
                                                          exchange, walker(), offload, own))

            load = _load(layer_work(profile, unit, recompute), d, _holders(schedule))
            sizes = _climb(_least_over(sizes, peak, load, memory_limit), simulated, limit=rounds)
    return cache[tuple(sizes)] if tuple(sizes) in cache else evaluate(sizes)

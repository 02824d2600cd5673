"""The optimizer-sharding pass (``--shard-optimizer``, ZeRO-1): which rank of each stage's group keeps, and steps,
each parameter's optimizer state.

    shards = shard_pass(cfg, chain, schedule, stage_layers)     # None without the flag
    shards.owners[s]                                           # ((name, bytes, owner rank), ...)
    plan(profile, ..., optimizer_owned=owned_pricer(chain))   # the planner prices the same assignment

Whole parameters, balanced by bytes: over every stage together, the largest first, each to the rank of its stage's
group (``Schedule.stage_group``) owning the fewest bytes so far (ties: the lower rank); the stages' parameters are
read from a meta-device build of their layers (nothing is allocated). The Job carries the result, so every rank runs the same
assignment and the memory model prices the same shares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from chimera.config import ConfigError, TrainConfig
from chimera.job import OptimizerShards
from chimera.models import LayerChain, build_stage
from chimera.plan.sharding import Owned, shard_offload_refusal
from chimera.schedule import Schedule


def stage_parameters(chain: LayerChain, layers: Sequence[int]) -> list[tuple[str, int]]:
    """``(layer{i}.{param}, bytes)`` of a stage's parameters in its module's order, a shared one once
    (``StageModule.named_once``)."""
    mod = build_stage(chain, layers, 0, device=torch.device("meta"))
    return [(name, p.numel() * p.element_size()) for name, p in mod.named_once()]


def assign(stages: Mapping[int, Sequence[tuple[str, int]]], groups: Mapping[int, Sequence[int]]
           ) -> dict[int, tuple[tuple[str, int, int], ...]]:
    """Every parameter of every stage with its owner in the stage's group: over all stages together, the largest
    first, to the group's rank owning the fewest bytes so far over every stage (ties: the lower rank), so that a rank
    holding two stages' largest parameters is avoided; each stage's listed in its own order."""
    load: dict[int, int] = {}
    owner: dict[tuple[int, int], int] = {}
    order = sorted(((s, k) for s, params in stages.items() for k in range(len(params))),
                   key=lambda sk: (-stages[sk[0]][sk[1]][1], sk))
    for s, k in order:
        r = min(sorted(groups[s]), key=lambda r: (load.get(r, 0), r))
        owner[(s, k)] = r
        load[r] = load.get(r, 0) + stages[s][k][1]
    return {s: tuple((name, nbytes, owner[(s, k)]) for k, (name, nbytes) in enumerate(params))
            for s, params in stages.items()}


def shard_pass(cfg: TrainConfig, chain: LayerChain, schedule: Schedule, stage_layers: Sequence[Sequence[int]]
               ) -> OptimizerShards | None:
    """The owners of every replicated stage's parameters under ``--shard-optimizer`` (module docstring); None
    without it. ConfigError naming what to change for what it does not support."""
    if not cfg.training.shard_optimizer:
        return None
    if cfg.memory.offload != "none":
        raise ConfigError(shard_offload_refusal(cfg.memory.offload))
    return optimizer_shards(chain, schedule, stage_layers)


def optimizer_shards(chain: LayerChain, schedule: Schedule, stage_layers: Sequence[Sequence[int]],
                     parameters: Callable[[tuple[int, ...]], Sequence[tuple[str, int]]] | None = None
                     ) -> OptimizerShards:
    """The owners of every replicated stage's parameters (module docstring); ConfigError naming what to change where
    the schedule or the data-parallel width does not allow it. ``parameters``: a stage's layers -> its
    :func:`stage_parameters` (a cache of them)."""
    params: dict[int, Sequence[tuple[str, int]]] = {}
    for s, layers in enumerate(stage_layers):
        group = schedule.stage_group(s)
        if schedule.stage_group_size(s) != len(group):
            raise ConfigError(f"--shard-optimizer: a worker holds two replicas of stage {s} in this schedule, and "
                              "their optimizer state cannot be split between them; drop --shard-optimizer or choose "
                              "another --schedule")
        if len(group) > 1:
            params[s] = parameters(tuple(layers)) if parameters is not None else stage_parameters(chain, layers)
    owners = assign(params, {s: schedule.stage_group(s) for s in params})
    shards = OptimizerShards(owners)
    world = schedule.workers * schedule.data_parallel
    for rank in range(world):
        held = [s for _, s in schedule.stages_of(rank % schedule.workers)]
        if held and all(s in owners for s in held) and not any(shards.owned_bytes(rank, s) for s in held):
            raise ConfigError(f"--shard-optimizer: rank {rank} would own no parameter's optimizer state (its stages "
                              f"{sorted(set(held))} have fewer parameters than replicas); use fewer --data-parallel "
                              "groups or drop --shard-optimizer")
    return shards


def owned_pricer(chain: LayerChain) -> Owned:
    """What the planner prices ``--shard-optimizer`` with (``plan(..., optimizer_owned=...)``): per candidate schedule
    and partition, each worker's owned parameter bytes per stage (``OptimizerShards.per_worker``) of the assignment
    training makes, or its ConfigError; each stage's parameters read once per layer range."""
    cache: dict[tuple[int, ...], list[tuple[str, int]]] = {}

    def parameters(layers: tuple[int, ...]) -> list[tuple[str, int]]:
        if layers not in cache:
            cache[layers] = stage_parameters(chain, layers)
        return cache[layers]

    def owned(schedule: Schedule, stage_layers: Sequence[Sequence[int]]) -> list[dict[int, int]]:
        return optimizer_shards(chain, schedule, stage_layers, parameters).per_worker(schedule)

    return owned

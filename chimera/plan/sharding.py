"""The planner's optimizer sharding (``--shard-optimizer``, ZeRO-1 over each stage's replicas): what it is given and
what it refuses. The owned shares themselves are training's (:func:`chimera.compile.shard.owned_pricer`), so that the
plan prices exactly the assignment the job will run."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from chimera.schedule import Schedule

#: per schedule (with its data-parallel width) and partition (each stage's layers): for every worker of one
#: data-parallel group, each sharded stage it holds -> the parameter bytes whose optimizer state it keeps
#: (``OptimizerShards.per_worker``); ValueError where the optimizer state cannot be sharded so
Owned = Callable[[Schedule, Sequence[Sequence[int]]], Sequence[Mapping[int, int]]]


def sharding(owned: Owned | None, fixed: Mapping[str, Any]) -> bool:
    """Whether the plan shards the optimizer state; ValueError naming what to change where it cannot."""
    if fixed.get("shard_optimizer") and owned is None:
        raise ValueError("shard_optimizer is fixed but the planner was given no owned shares (optimizer_owned)")
    offload = fixed.get("offload", "none")
    if owned is not None and offload != "none":
        raise ValueError(shard_offload_refusal(offload))
    return owned is not None


def shard_offload_refusal(offload: str) -> str:
    """Why ``--shard-optimizer`` and ``--offload OFFLOAD`` do not go together (the compiler's words too)."""
    return (f"--shard-optimizer with --offload {offload}: an offloaded stage keeps its whole optimizer state in the "
            "host store, which is not sharded; give --offload none or drop --shard-optimizer")

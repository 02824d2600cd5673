"""The partition pass: which layers every stage holds. A fixed method (``uniform``, ``params``, layer counts) or
the planned partition (a brief profile of the model as the workers will run it, then the split with the least
simulated step time under the memory limit), which also gives the run's prediction.

    decision = partition_pass(cfg, chain, schedule, unit, limit=None, log=print)
    decision.stage_layers, decision.prediction
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chimera.config import ConfigError, TrainConfig
from chimera.job import Prediction
from chimera.offload.policy import Offload
from chimera.plan.partition import layers_of, partition, plan_partition
from chimera.plan.profiles import cached_profile, local_comm, sharing
from chimera.profile import ProfileError
from chimera.schedule import Schedule


@dataclass(frozen=True)
class PartitionDecision:
    """The layers of every stage and, when planned, the planner's prediction for them."""

    stage_layers: list[list[int]]
    prediction: Prediction | None = None


def fixed_split(chain: Any, schedule: Schedule, method: str) -> list[list[int]]:
    """A fixed method's split of ``chain`` into ``schedule``'s stages (``planned`` is not a fixed method);
    ConfigError naming ``--partition``, and ``--schedule`` where it cuts the model into more stages than workers."""
    parts, workers = schedule.stages, schedule.workers
    if parts > chain.num_layers and parts != workers:
        raise ConfigError(f"--partition {method}: --schedule {schedule.name} with --stages {workers} cuts the model "
                          f"into {parts} stages, more than the {chain.num_layers} layers of {chain.name}; use fewer "
                          "--stages (or --chunks where the schedule takes it), another --schedule or a deeper model")
    try:
        return partition(chain, parts, method)
    except ValueError as e:
        raise ConfigError(f"--partition {method}: {e}") from None


def partition_pass(cfg: TrainConfig, chain: Any, schedule: Schedule, unit: int, threads: int, limit: int | None,
                   offload: Offload | None, log: Callable[[str], None] | None = None) -> PartitionDecision:
    """The split of ``cfg`` (module docstring). ``limit``: bytes per worker the planned split must fit;
    ``offload``: the policy it is priced with (None: ``--offload auto``, decided on the split afterwards)."""
    method = cfg.schedule.partition
    if method != "planned":
        return PartitionDecision(fixed_split(chain, schedule, method))
    t = cfg.training
    world = schedule.workers * schedule.data_parallel
    fixed_split(chain, schedule, "uniform")  # D within the model's layers: a clear error before profiling
    try:
        prof = cached_profile(chain, [unit], t.device, threads, sharing(world, t.device),
                              comm=local_comm(world, t.device), progress=log)
        part = plan_partition(prof, schedule, unit, t.recompute, t.optimizer, limit, exchange=t.device != "cuda",
                              offload=offload, clip=t.clip_grad > 0, post_validated=t.post_validate)
    except (ValueError, ProfileError) as e:
        raise ConfigError(f"--partition planned: {e}") from None
    source = f"{prof.model} on {prof.device}, {prof.threads} thread(s), partition {','.join(map(str, part.sizes))}"
    return PartitionDecision(layers_of(part.sizes), Prediction(part.step_s, source, part.bubble, part.peak_memory))

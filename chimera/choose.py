"""What a configuration runs, decided before any worker starts: its compute-only schedule (built by name, chosen
by ``--schedule auto`` with the memory model's verdict, or read from ``--schedule-file``), the partition method,
and the check that the memory model fits a worker.

Used by :meth:`chimera.config.TrainConfig.check`::

    sched, cfg, why = resolve_schedule(cfg, chain)   # auto: the config of the chosen schedule and why
    check_memory(cfg, chain, sched)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chimera.models import LayerChain, partition
from chimera.schedule import Schedule, ScheduleConfigError, build_schedule
from chimera.schedule.io import load_schedule_file
from chimera.validation import ConfigError

if TYPE_CHECKING:
    from chimera.config import TrainConfig


def resolve_schedule(cfg: TrainConfig, chain: LayerChain | None) -> tuple[Schedule, TrainConfig, str | None]:
    """The compute-only schedule of ``cfg`` (built, chosen by ``auto``, or read from ``--schedule-file``); for auto,
    the config of the chosen schedule and why it was chosen."""
    s = cfg.schedule
    try:
        if s.schedule_file is not None:
            sched = load_schedule_file(s.schedule_file, s.stages, s.micro_batches)
            return sched.with_data_parallel(s.data_parallel), cfg, f"schedule file {s.schedule_file}"
        if s.name != "auto":
            return build_schedule(s.name, s.stages, s.micro_batches, chunks=s.chunks, mode=s.mode,
                                  data_parallel=s.data_parallel, split_backward=s.split_backward), cfg, None
        from chimera.schedule.best import auto_costs, best, explain

        costs, halving = auto_costs(chain, s.stages, s.micro_batch_size)
        _, ranked = best(s.stages, s.micro_batches, costs, halving=halving, layers=chain.num_layers)
        ranked = _fit_choice(cfg, chain, ranked)
        choice = ranked[0]
    except ScheduleConfigError as e:
        raise ConfigError(str(e) if "--" in str(e) else f"--schedule {s.name}: {e}") from None
    o = choice.options
    chosen = cfg.with_flags(schedule=choice.name, mode=o.get("mode", s.mode), chunks=o.get("chunks", s.chunks),
                            split_backward=o.get("split_backward", False))
    return choice.schedule.with_data_parallel(s.data_parallel), chosen, explain(choice, ranked)


def _fit_choice(cfg: TrainConfig, chain: LayerChain, ranked: list[Any]) -> list[Any]:
    """auto's ranking with the candidates the memory model says cannot fit a worker marked (weights included)."""
    from chimera.plan.fit import fit_choice

    method = _priced_split(cfg)
    return fit_choice(cfg, chain, ranked, lambda stages: partition(chain, stages, method))


def _priced_split(cfg: TrainConfig) -> str | list[int]:
    """The partition method memory is priced on before any worker starts: the uniform split for a planned one."""
    return "uniform" if cfg.model.partition == "planned" else partition_method(cfg.model.partition)


def check_memory(cfg: TrainConfig, chain: LayerChain, sched: Any) -> None:
    """Refuse a configuration the memory model says cannot fit the memory a worker has (the uniform split stands in
    for a planned one). A ``--memory-per-worker`` budget is checked later, with offload, by :func:`chimera.plan.fit.fit_budget`."""
    from chimera.plan.fit import check_fits

    if cfg.training.memory_per_worker is not None:
        return

    try:
        check_fits(cfg, chain, sched, partition(chain, sched.stages, _priced_split(cfg)))
    except ConfigError:
        raise
    except ValueError:
        return  # a bad --partition or a chain that cannot be priced: the checks that follow report it


def partition_method(text: str) -> str | list[int]:
    if text in ("uniform", "params"):
        return text
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--partition must be 'uniform', 'params', 'planned' or layer counts like '2,2,1,1', got "
                          f"{text!r}") from None

"""The schedule pass: the compute-only schedule a request runs, built from the registry by name, read from
``--schedule-file``, or chosen by ``--schedule auto`` (every candidate simulated, those that cannot fit the memory
marked, the fastest that fits taken).

    decision = resolve_schedule(cfg, model, budget, shapes)
    decision.schedule, decision.layout, decision.unit, decision.why
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from chimera.compile.memory import Budget, Shapes, exclude_over_budget
from chimera.compile.model import Model
from chimera.config import ConfigError, TrainConfig
from chimera.job import Layout
from chimera.plan.partition import partition
from chimera.schedule import Costs, Schedule, ScheduleConfigError, build_schedule
from chimera.schedule.best import best, explain
from chimera.schedule.io import load_schedule_file
from chimera.schedule.registry import get as schedule_spec


@dataclass(frozen=True)
class ScheduleDecision:
    """The compute-only schedule (all data-parallel groups alike), how it pipelines (``layout``), the samples per
    schedule unit (computed here, once), and why it was chosen when not named."""

    schedule: Schedule
    layout: Layout
    unit: int
    why: str | None = None


def _layout(cfg: TrainConfig, name: str, options: dict[str, Any]) -> Layout:
    s = cfg.schedule
    return Layout(name, s.stages, s.micro_batches, s.micro_batch_size, s.data_parallel,
                  options.get("mode", s.mode), options.get("chunks", s.chunks),
                  options.get("split_backward", s.split_backward))


def _decision(cfg: TrainConfig, sched: Schedule, name: str, options: dict[str, Any], why: str | None
              ) -> ScheduleDecision:
    unit = Fraction(cfg.schedule.micro_batch_size) * sched.microbatch_scale
    if unit.denominator != 1:
        raise ConfigError(f"--micro-batch-size {cfg.schedule.micro_batch_size} cannot be cut into the schedule's "
                          f"units of {sched.microbatch_scale} micro-batch: give a multiple of "
                          f"{sched.microbatch_scale.denominator}")
    return ScheduleDecision(sched.with_data_parallel(cfg.schedule.data_parallel), _layout(cfg, name, options),
                            int(unit), why)


def resolve_schedule(cfg: TrainConfig, model: Model, budget: Budget, shapes: Shapes) -> ScheduleDecision:
    """The schedule of ``cfg`` (module docstring); ConfigError with the flag to change."""
    s = cfg.schedule
    try:
        if s.schedule_file is not None:
            sched = load_schedule_file(s.schedule_file, s.stages, s.micro_batches)
            return _decision(cfg, sched, sched.name, {}, f"schedule file {s.schedule_file}")
        if s.name != "auto":
            spec = schedule_spec(s.name)
            options = {"mode": s.mode, "chunks": s.chunks, "split_backward": s.split_backward}
            sched = build_schedule(spec.name, s.stages, s.micro_batches, **options)
            return _decision(cfg, sched, spec.name, options, None)
        return _auto(cfg, model, budget, shapes)
    except ScheduleConfigError as e:
        raise ConfigError(str(e) if "--" in str(e) else f"--schedule {s.name}: {e}") from None


def _auto(cfg: TrainConfig, model: Model, budget: Budget, shapes: Shapes) -> ScheduleDecision:
    s = cfg.schedule
    chain = model.chain
    costs, halving = auto_costs(chain, s.stages, s.micro_batch_size)
    _, ranked = best(s.stages, s.micro_batches, costs, halving=halving, layers=chain.num_layers)
    method = "uniform" if s.partition == "planned" else s.partition
    ranked = exclude_over_budget(cfg, ranked, lambda stages: partition(chain, stages, method), budget, shapes)
    choice = ranked[0]
    assert choice.schedule is not None
    options = {k: v for k, v in choice.options.items() if k != "order_costs"}
    return _decision(cfg, choice.schedule, choice.name, options, explain(choice, ranked))


def auto_costs(chain: Any, stages: int, micro_batch_size: int) -> tuple[Costs, bool]:
    """The costs of one worker's share ``--schedule auto`` simulates with, and whether backward halving is a
    candidate.

    The delay model's sleeps (tf, tb, tw per block, times the blocks of a share) exactly, without halving (a
    sleep does not shrink with the micro-batch); any other model F = I = W (a backward twice a forward, half of
    it weight gradients), with halving where the micro-batch size is even.
    """
    seconds = getattr(chain, "block_seconds", None)
    if seconds is not None:
        share = Fraction(chain.config.num_blocks, stages)
        tf, tb, tw = (float(t * share) for t in seconds)
        return Costs(fwd=tf, bwd=tb, wgrad=tw), False
    return Costs(fwd=1, bwd=1, wgrad=1), micro_batch_size % 2 == 0

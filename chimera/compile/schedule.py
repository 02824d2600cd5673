"""The schedule pass: the compute-only schedule a request runs, built from the registry by name, read from
``--schedule-file``, or chosen by ``--schedule auto`` (every candidate simulated, those that cannot fit the memory
marked, the fastest that fits taken).

    decision = resolve_schedule(cfg, model, budget, shapes)
    decision.schedule, decision.layout, decision.unit, decision.why
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from chimera.compile.memory import Budget, Shapes, exclude_over_budget
from chimera.compile.model import Model
from chimera.compile.shard import owned_pricer, shard_pass
from chimera.config import ConfigError, TrainConfig
from chimera.job import Layout, Prediction
from chimera.plan import plan
from chimera.plan.partition import partition
from chimera.plan.period import STEADY_STEPS, by_period, tied_stages
from chimera.plan.period import steps_overlap as overlapping
from chimera.plan.profiles import cached_profile, local_comm, sharing
from chimera.profile import ProfileError
from chimera.schedule import Costs, Schedule, ScheduleConfigError, build_schedule
from chimera.schedule.best import best, explain, per_stage
from chimera.schedule.io import load_schedule_file
from chimera.schedule.registry import get as schedule_spec


@dataclass(frozen=True)
class ScheduleDecision:
    """The compute-only schedule (all data-parallel groups alike), how it pipelines (``layout``), the samples per
    schedule unit (computed here, once), why it was chosen when not named, and, when ``auto`` ranked with the
    model's profile, the planned split it was ranked with and its prediction."""

    schedule: Schedule
    layout: Layout
    unit: int
    why: str | None = None
    planned: list[int] | None = None
    prediction: Prediction | None = None


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


def resolve_schedule(cfg: TrainConfig, model: Model, budget: Budget, shapes: Shapes, threads: int = 1,
                     log: Callable[[str], None] | None = None) -> ScheduleDecision:
    """The schedule of ``cfg`` (module docstring); ConfigError with the flag to change. ``threads`` and ``log``:
    for the brief profile ``auto`` ranks a model with."""
    s = cfg.schedule
    try:
        if s.schedule_file is not None:
            sched = load_schedule_file(s.schedule_file, s.stages, s.micro_batches)
            return _decision(cfg, sched, sched.name, {}, f"schedule file {s.schedule_file}")
        if s.name != "auto":
            spec = schedule_spec(s.name)
            options = {"mode": s.mode, "chunks": s.chunks, "split_backward": s.split_backward}
            sched = build_schedule(spec.name, s.stages, s.micro_batches, **options,
                                   **_order_costs(spec, model.chain, s.stages, s.micro_batch_size, options))
            return _decision(cfg, sched, spec.name, options, None)
        if getattr(model.chain, "block_seconds", None) is not None:  # a model that knows its costs exactly
            return _auto(cfg, model, budget, shapes)
        return _auto_profiled(cfg, model, budget, threads, log)
    except ScheduleConfigError as e:
        raise ConfigError(str(e) if "--" in str(e) else f"--schedule {s.name}: {e}") from None


def _auto(cfg: TrainConfig, model: Model, budget: Budget, shapes: Shapes) -> ScheduleDecision:
    s = cfg.schedule
    chain = model.chain
    costs, halving = auto_costs(chain, s.stages, s.micro_batch_size)
    by = "period" if steps_overlap(cfg) else "makespan"
    method = "uniform" if s.partition == "planned" else s.partition

    def split(stages: int) -> list[list[int]]:
        return partition(chain, stages, method)

    pairs = [(a, b) for (a, _), (b, _) in chain.tied_parameters()]
    _, ranked = best(s.stages, s.micro_batches, costs, halving=halving, layers=chain.num_layers,
                     steps=STEADY_STEPS if by == "period" else 1, by=by, joint=False,
                     tied=(lambda parts: tied_stages(pairs, split(parts))) if pairs else None)

    def owned(sched: Schedule) -> list[dict[int, int]] | None:  # --shard-optimizer: each candidate's own shares
        wide = sched.with_data_parallel(s.data_parallel)
        shards = shard_pass(cfg, chain, wide, split(sched.stages))
        return shards.per_worker(wide) if shards is not None else None

    ranked = exclude_over_budget(cfg, ranked, split, budget, shapes, owned, by)
    choice = ranked[0]
    assert choice.schedule is not None
    options = {k: v for k, v in choice.options.items() if k != "order_costs"}
    return _decision(cfg, choice.schedule, choice.name, options, explain(choice, ranked, by))


def steps_overlap(cfg: TrainConfig) -> bool:
    """Whether the runtime overlaps consecutive steps (a worker starts its next step as soon as its own list allows;
    :func:`chimera.plan.period.steps_overlap`). Then the steady state's period is what a run measures, and
    ``auto`` ranks by it (``chimera.schedule.steps``); else by one step's makespan."""
    return overlapping(cfg.training.clip_grad > 0, cfg.training.post_validate)


def _auto_profiled(cfg: TrainConfig, model: Model, budget: Budget, threads: int,
                   log: Callable[[str], None] | None) -> ScheduleDecision:
    """``auto`` for a model measured, not known: every candidate of the registry that ``auto`` tries, at the given
    D, N, B and W, planned and simulated with the model's own brief profile (the one a planned partition takes:
    messages, gradient sums and optimizer step included), within the memory a worker has; the fastest wins."""
    s, t = cfg.schedule, cfg.training
    world = s.stages * s.data_parallel
    sizes = sorted({s.micro_batch_size} | ({s.micro_batch_size // 2} if s.micro_batch_size % 2 == 0 else set()))
    try:
        prof = cached_profile(model.chain, sizes, t.device, threads, sharing(world, t.device),
                              comm=local_comm(world, t.device), progress=log)
    except ProfileError as e:
        raise ConfigError(f"--schedule auto: profiling the model failed: {e}") from None
    fixed = {"stages": s.stages, "data_parallel": s.data_parallel, "micro_batch_size": s.micro_batch_size,
             "micro_batches": s.micro_batches, "recompute": t.recompute}
    if cfg.memory.offload != "auto":
        fixed["offload"] = cfg.memory.offload
    # every candidate priced, none pruned: the plain schedules are compared with the fastest (a dozen candidates)
    owned = owned_pricer(model.chain) if t.shard_optimizer else None  # --shard-optimizer: as _auto prices it
    try:
        result = plan(prof, world, s.micro_batches * s.micro_batch_size * s.data_parallel, budget.bytes, t.optimizer,
                      exchange=t.device != "cuda", fixed=fixed, prune=False, optimizer_owned=owned,
                      clip=t.clip_grad > 0, post_validated=t.post_validate)
    except ValueError as e:
        raise ConfigError(f"--schedule auto: {e}") from None
    ranked = [e for e in result.ranked if e.candidate.spec.auto]
    by = "period" if steps_overlap(cfg) else "makespan"
    if by == "period":  # consecutive steps overlap in the runtime: what a run measures is the steady state
        ranked = _by_period(ranked, prof, cfg)
    if not ranked:
        reasons = sorted({e.reason for e in result.infeasible if e.reason})[:3]
        raise ConfigError(f"--schedule auto: no schedule runs D={s.stages}, N={s.micro_batches} here: "
                          f"{'; '.join(reasons)}")
    best_ev = _trusted_best(ranked)
    c = best_ev.candidate
    options = {"mode": c.mode, "chunks": c.chunks, "split_backward": c.split_backward}
    sched = build_schedule(c.schedule, s.stages, s.micro_batches, **options)
    why = _why_profiled(ranked, best_ev, prof.model, prof.device, by)
    prediction = Prediction(float(best_ev.step_s or 0.0), f"auto: {prof.model} on {prof.device}, {prof.threads} "
                            "thread(s)" + (f", period of {STEADY_STEPS} overlapped steps" if by == "period" else ""),
                            best_ev.bubble, best_ev.peak_memory)
    decision = _decision(cfg, sched, c.schedule, options, why)
    return replace(decision, planned=best_ev.partition, prediction=prediction)


#: how much faster than plain Chimera (or 1F1B) another schedule must be predicted before a measured model's auto
#: takes it: the planner's predictions on a CPU shared by its workers miss by up to this much, schedule against
#: schedule (bench/plan_accuracy.py, bench/default_auto.py in bench/RESULTS.md)
TRUSTED_GAIN = 1.15


def _trusted_best(ranked: list[Any]) -> Any:
    """The fastest candidate, unless plain Chimera (else 1F1B), whole backward and direct, is predicted within
    :data:`TRUSTED_GAIN` of it: then that one, the simpler schedule, which the prediction cannot tell apart."""
    best_ev = ranked[0]
    for name in ("chimera-direct", "1f1b"):
        plain = next((e for e in ranked if e.candidate.label == name), None)
        if plain is not None:
            return plain if plain.step_s <= TRUSTED_GAIN * best_ev.step_s else best_ev
    return best_ev


def _by_period(ranked: list[Any], prof: Any, cfg: TrainConfig) -> list[Any]:
    """The planner's candidates ranked by the steady state's period with training's optimizer, clipping and
    post-validation (:func:`chimera.plan.period.by_period`)."""
    t = cfg.training
    return by_period(ranked, prof, t.optimizer, t.clip_grad > 0, t.post_validate, STEADY_STEPS)


def _why_profiled(ranked: list[Any], chosen: Any, model: str, device: str, by: str = "makespan") -> str:
    """auto's choice against the plain schedules and the runner-up, with the model's predicted step times (``by``
    ``period``: the steady state's)."""
    best_ev = chosen
    step = {e.candidate.label: e.step_s for e in ranked}
    what = " in the steady state" if by == "period" else ""
    why = (f"auto: {best_ev.candidate.spec.label(best_ev.candidate.options)}: predicted {best_ev.step_s:.4g} s/step"
           f"{what} with {model}'s profile on {device}")
    for ref in ("chimera-direct", "1f1b"):
        if ref in step and ref != best_ev.candidate.label:
            why += f", {step[ref] / best_ev.step_s:.3f}x as fast as {ref.replace('-direct', '')} ({step[ref]:.4g} s)"
    if ranked[0] is not chosen:
        top = ranked[0]
        why += (f"; kept rather than {top.candidate.spec.label(top.candidate.options)} ({top.step_s:.4g} s): a gain "
                f"of {chosen.step_s / top.step_s:.3f}x is within the {TRUSTED_GAIN}x the predictions are trusted to")
    elif len(ranked) > 1:
        nxt = ranked[1].candidate
        why += f"; next: {nxt.spec.label(nxt.options)} ({ranked[1].step_s:.4g} s)"
    return why


def _order_costs(spec: Any, chain: Any, stages: int, micro_batch_size: int, options: dict[str, Any]
                 ) -> dict[str, Costs]:
    """A list-ordered schedule named by ``--schedule`` is ordered with the costs ``auto`` ranks with
    (:func:`auto_costs`), per stage as the runtime runs them (the first stage's I empty, its W the whole backward),
    as ``auto``'s own pick of it is; ``{}`` for a schedule whose order takes no costs."""
    if "order_costs" not in spec.takes:
        return {}
    chunks = spec.chunks_of(options)
    split = per_stage(auto_costs(chain, stages, micro_batch_size)[0], chunks)
    return {"order_costs": split.first_stage_whole_backward(stages * chunks)}


def auto_costs(chain: Any, stages: int, micro_batch_size: int) -> tuple[Costs, bool]:
    """The costs of one worker's share ``--schedule auto`` simulates with, and whether backward halving is a
    candidate.

    A model that knows its costs (``block_seconds``, the delay model: tf, tb, tw per block, times the blocks of a
    share) exactly, for the micro-batch's rows when its seconds are for a number of rows (``config.rows``), and then
    with halving where the micro-batch size is even (half a micro-batch takes half as long), else without (its
    seconds do not shrink with the micro-batch); any other model F = I = W (a backward twice a forward, half of it
    weight gradients), with halving where the micro-batch size is even.
    """
    seconds = getattr(chain, "block_seconds", None)
    if seconds is not None:
        rows = getattr(chain.config, "rows", None)
        share = Fraction(chain.config.num_blocks, stages) * (Fraction(micro_batch_size, rows) if rows else 1)
        tf, tb, tw = (float(t * share) for t in seconds)
        return Costs(fwd=tf, bwd=tb, wgrad=tw), bool(rows) and micro_batch_size % 2 == 0
    return Costs(fwd=1, bwd=1, wgrad=1), micro_batch_size % 2 == 0

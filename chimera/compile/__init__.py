"""The compiler: a request (and a model) to the :class:`~chimera.job.Job` the workers run, as a short list of
passes, each a function with typed input and output.

    job = compile_job(TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=4))
    job = compile_job(cfg, chain, data)          # chimera.train: a user's chain and data
    resolved_config(cfg, job)                   # the request with every decision written in: --config reproduces it

Passes: the request's fields on their own, then the names from the registries; the model; ``--plan``; the
schedule (registry, file or ``auto``); the partition; the optimizer state's owners (``--shard-optimizer``); one
memory verdict (which also chooses the offload); the lowering; the validator; checkpoints. Every error is a
:class:`~chimera.config.ConfigError` naming the flag to change, raised before any worker starts.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chimera.checkpoint import CheckpointError, complete, resume_point
from chimera.compile.memory import Budget, BudgetError, Shapes, budget_of, memory_verdict
from chimera.compile.model import VOCAB_SPLITS, Model, resolve_model, vocab_splittable
from chimera.compile.names import check_names, choices
from chimera.compile.partition import PartitionDecision, fixed_split, partition_pass
from chimera.compile.plan import apply_plan
from chimera.compile.schedule import ScheduleDecision, resolve_schedule
from chimera.compile.shard import shard_pass
from chimera.config import ConfigError, TrainConfig, check_fields
from chimera.job import CheckpointOptions, Job, RunOptions, TimelineOptions
from chimera.models import ChainError, LayerChain
from chimera.offload.policy import Offload
from chimera.plan.partition import layers_of
from chimera.schedule import ScheduleError, validate
from chimera.timeline import tensorboard
from chimera.util.source import source_fingerprint, source_root

__all__ = ["Budget", "ConfigError", "Model", "PartitionDecision", "ScheduleDecision", "choices", "compile_job",
           "default_run_dir", "resolved_config", "run_name", "worker_threads"]


def worker_threads(cfg: TrainConfig, world: int) -> int:
    """Torch threads of one worker: ``--threads``, else this machine's cores shared among the ``world`` workers."""
    return cfg.training.threads or max(1, (os.cpu_count() or 1) // max(1, world))


def run_name(model: str, decision: ScheduleDecision, device: str, payload: str) -> str:
    """``{model}_{schedule}_{D}stages_{workers}{gpus|workers}_microbs{B}_acc{N/D}`` (``_single-byte`` when the
    messages carry one byte): the name of the run's outputs."""
    lay = decision.layout
    acc = max(1, lay.micro_batches // lay.stages)
    unit = "gpus" if device == "cuda" else "workers"
    tail = "" if payload == "full" else f"_{payload}"
    return (f"{model}_{lay.schedule}_{lay.stages}stages_{lay.stages * lay.data_parallel}{unit}_"
            f"microbs{lay.micro_batch_size}_acc{acc}{tail}")


def default_run_dir(name: str) -> Path:
    """Where a run's outputs go unless told: ``runs/NAME-TIME`` (a new directory per run)."""
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def compile_job(cfg: TrainConfig, chain: LayerChain | None = None, data: Any = None, *,
                log: Callable[[str], None] | None = None) -> Job:
    """The Job of a request (module docstring); ``log`` hears what takes a while (profiling)."""
    try:
        return _compile(cfg, chain, data, log)
    except BudgetError as refusal:
        if chain is not None or not vocab_splittable(cfg):
            raise
        return _split_vocabulary(cfg, data, log, refusal)


def _split_vocabulary(cfg: TrainConfig, data: Any, log: Callable[[str], None] | None, refusal: BudgetError) -> Job:
    """``--offload auto`` when no policy fits the model as it is: the fewest vocabulary shards (``VOCAB_SPLITS``)
    with which one fits; the same model (``seed_index``), so the run is the one asked for."""
    for k in VOCAB_SPLITS:
        try:
            job = _compile(cfg.with_flags(vocab_shards=k), None, data, log)
        except BudgetError:
            continue
        why = (f"vocab auto: the token embedding and the LM head split by vocabulary into {k} layers each "
               f"(--vocab-shards {k}; the same model and initial weights): unsplit, no offload fits (the least needs "
               f"{refusal.least} bytes, budget {job.memory_budget})")
        return dataclasses.replace(job, decisions=(why, *job.decisions))
    raise ConfigError(f"{refusal}\nsplit by vocabulary into up to {VOCAB_SPLITS[-1]} shards (--vocab-shards), it does "
                      "not fit either") from None


def _compile(cfg: TrainConfig, chain: LayerChain | None, data: Any, log: Callable[[str], None] | None) -> Job:
    check_fields(cfg)
    check_names(cfg)
    model = resolve_model(cfg, chain, data)
    if model.micro_batch_size is not None:  # the data's micro-batches define B
        cfg = cfg.with_flags(micro_batch_size=model.micro_batch_size)
        check_fields(cfg)
    s = cfg.schedule
    cfg, plan_prediction, plan_why = apply_plan(cfg, model.chain, worker_threads(cfg, s.stages * s.data_parallel),
                                                log)
    s, t = cfg.schedule, cfg.training
    world = s.stages * s.data_parallel
    threads = worker_threads(cfg, world)
    shapes = Shapes(model.chain)
    budget = budget_of(cfg, world)
    decision = resolve_schedule(cfg, model, budget, shapes, threads, log)
    sched, unit = decision.schedule, decision.unit
    if s.partition == "planned" and decision.planned is not None:  # auto ranked it planned with the model's profile
        part = PartitionDecision(layers_of(decision.planned), decision.prediction)
    else:
        if s.partition == "planned":  # screened on the uniform split first: no profile for what cannot fit
            memory_verdict(cfg, model.chain, sched, fixed_split(model.chain, sched, "uniform"), unit, budget,
                           shapes)
        part = partition_pass(cfg, model.chain, sched, unit, threads, budget.bytes if budget.enforced else None,
                              None if cfg.memory.offload == "auto" else _planning_offload(cfg, sched.stages), log)
    shards = shard_pass(cfg, model.chain, sched, part.stage_layers)
    verdict = memory_verdict(cfg, model.chain, sched, part.stage_layers, unit, budget, shapes, shards)
    try:
        lowered = validate(verdict.lowered)
        boundaries = model.chain.boundaries(unit)
    except (ChainError, ScheduleError) as e:
        raise ConfigError(str(e)) from None
    prediction = plan_prediction or part.prediction
    job = Job(
        name=run_name(model.chain.name, decision, t.device, cfg.profiling.comm_payload), model=model.chain.name,
        chain=model.chain, data=model.data, schedule=lowered, layout=decision.layout,
        stage_layers=part.stage_layers, boundaries=boundaries, unit_size=unit, run=_run_options(cfg, threads),
        offload=verdict.offload, memory_budget=budget.bytes if budget.enforced else None,
        timeline=_timeline(cfg), checkpoint=_checkpoint(cfg), prediction=prediction,
        decisions=tuple(w for w in (plan_why, decision.why, verdict.why) if w), shards=shards,
        source=(source_fingerprint(), source_root()))
    return _resume(cfg, job)


def _planning_offload(cfg: TrainConfig, stages: int) -> Offload:
    """The configured policy the planned partition is priced with."""
    m = cfg.memory
    try:
        off = Offload.parse(m.offload, m.prefetch, m.offload_pack)
        off.check(stages)
    except ValueError as e:
        raise ConfigError(f"--offload {m.offload}: {e}") from None
    return off


def _run_options(cfg: TrainConfig, threads: int) -> RunOptions:
    t = cfg.training
    return RunOptions(t.steps, t.seed, t.device, t.optimizer, t.lr, t.weight_decay, t.warmup_steps, t.lr_schedule,
                      t.clip_grad, t.recompute, t.amp, t.timeout_s, threads, t.python_gc, t.check_replicas,
                      cfg.profiling.comm_payload, t.debug_stall, t.post_validate, t.p2p, t.cpu_affinity,
                      t.p2p_spin_s)


def _timeline(cfg: TrainConfig) -> TimelineOptions:
    p = cfg.profiling
    if p.tensorboard and not tensorboard.available():
        raise ConfigError(tensorboard.MISSING)
    return TimelineOptions(p.profile, tuple(p.profile_steps), p.nsys, p.profile_memory, p.tensorboard)


def _checkpoint(cfg: TrainConfig) -> CheckpointOptions:
    c = cfg.checkpoint
    return CheckpointOptions(os.path.abspath(c.dir) if c.dir else None, c.every, c.keep_last, c.debug_kill_in_save)


def _resume(cfg: TrainConfig, job: Job) -> Job:
    """The job started from ``--resume``'s checkpoint, verified against it (another model, optimizer or seed, or no
    step left to run, is refused). A ``--checkpoint-dir`` that holds another run's checkpoints is refused: a run
    writes into a directory it resumes from, or a new one."""
    path, root = cfg.checkpoint.resume, job.checkpoint.dir
    if root is not None and complete(root):
        ours = path is not None and Path(path).resolve().is_relative_to(Path(root).resolve())
        if not ours:
            raise ConfigError(f"--checkpoint-dir {cfg.checkpoint.dir} holds another run's checkpoints (the newest: "
                              f"{complete(root)[-1].name}): continue that run with --resume {cfg.checkpoint.dir}, or "
                              "give a new --checkpoint-dir")
    if path is None:
        return job
    try:
        return dataclasses.replace(job, resume=resume_point(job, path))
    except CheckpointError as e:
        raise ConfigError(f"--resume {path}: {e}") from None


def resolved_config(cfg: TrainConfig, job: Job) -> TrainConfig:
    """``cfg`` with the compiler's decisions written in (the schedule ``auto`` or the plan chose, the partition,
    the offload of every stage, the threads), so that ``--config`` of it builds the same job."""
    lay = job.layout
    flags: dict[str, Any] = {"stages": lay.stages, "micro_batches": lay.micro_batches,
                             "micro_batch_size": lay.micro_batch_size, "data_parallel": lay.data_parallel,
                             "mode": lay.mode, "chunks": lay.chunks, "split_backward": lay.split_backward,
                             "partition": ",".join(str(len(x)) for x in job.stage_layers), "plan": None,
                             "threads": job.run.threads, "offload": job.offload.text,
                             "recompute": job.run.recompute}
    moving = job.offload.moving
    if moving:  # how the weights move (auto may have chosen prefetch 0 or packs)
        flags.update(prefetch=moving.prefetch, offload_pack=moving.pack)
    if cfg.schedule.schedule_file is None:
        flags["schedule"] = lay.schedule
    if cfg.model.chain is None and getattr(job.chain, "vocab_shards", 1) != cfg.model.vocab_shards:
        flags["vocab_shards"] = job.chain.vocab_shards  # --offload auto split the vocabulary
    if cfg.model.chain is None and cfg.model.seq_len is None:
        flags["seq_len"] = getattr(job.chain, "seq_len", None)
    return cfg.with_flags(**flags)

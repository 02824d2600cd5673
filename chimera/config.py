"""The one training configuration, in sections, validated once into the :class:`Job` every worker runs.

Usage::

    from chimera.config import TrainConfig, ModelConfig, ScheduleConfig

    cfg = TrainConfig(model=ModelConfig("bert-tiny", seq_len=32), schedule=ScheduleConfig("chimera", stages=2))
    cfg = TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=4)   # the command line's names
    job = cfg.check()    # raises ConfigError with what to change, before any worker starts

Sections: ``model`` (what to train), ``schedule`` (how to pipeline it), ``training`` (optimisation and the
runtime), ``profiling`` (timelines). Options of the Ray launcher live with it (``ray_launch.config``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chimera.choose import check_memory, partition_method, resolve_schedule
from chimera.data import CorpusError, load_info, resolve_corpus
from chimera.data.pretrain import check_fit
from chimera.job import Job
from chimera.models import ChainError, LayerChain, build_model, partition
from chimera.optim import OPTIMIZERS
from chimera.optim import SCHEDULES as LR_SCHEDULES
from chimera.schedule import CHIMERA_MODES, OFFLOAD_POLICIES, validate
from chimera.validation import ConfigError, type_ok, writable_path

PAYLOADS = ("full", "single-byte")
PYTHON_GC = ("step", "auto")  # chimera.runtime.host_memory.StepCollector, or Python's automatic collector


@dataclass(frozen=True)
class ModelConfig:
    """What to train: a preset (``name``) or a user's chain, its data and its split into stages."""

    name: str = "bert-mini"
    seq_len: int | None = 64
    corpus: str = "sample"  # "sample" (shipped Wikipedia extract), "synthetic" (random tokens) or a corpus path
    overrides: Mapping[str, Any] = field(default_factory=dict)
    partition: str = "uniform"


@dataclass(frozen=True)
class ScheduleConfig:
    """How to pipeline: schedule, depth D, micro-batches N of B samples, data-parallel width W."""

    name: str = "chimera"
    stages: int = 4
    micro_batches: int = 4
    micro_batch_size: int = 4
    data_parallel: int = 1
    chunks: int = 2
    mode: str = "direct"
    split_backward: bool = False
    schedule_file: str | None = None  # a compute-only schedule (our JSON, or a torch.distributed.pipelining CSV)


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation and runtime behaviour."""

    steps: int = 10
    seed: int = 1234
    device: str = "cpu"
    optimizer: str = "lamb"
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    clip_grad: float = 1.0
    recompute: bool = False
    amp: bool = True
    timeout_s: float = 120.0
    threads: int | None = None
    python_gc: str = "step"  # step: Python's garbage collector between steps only; auto: Python's default
    memory_per_worker: str | None = None  # e.g. "80GiB": the planner's memory limit and the runtime's budget
    offload: str = "none"  # none, optimizer, optimizer+gradients, everything, a comma list of those (one per stage),
    # or auto (the least per stage that fits)
    prefetch: int = 1  # weights offloaded: swap a stage's weights in this many compute actions ahead
    offload_pack: int = 0  # weights offloaded: swap them in packs of this many layers inside compute (0: stages)
    check_replicas: bool = False
    debug_stall: tuple[int, float] | None = None  # (worker rank, seconds): fault injection for timeout tests
    checkpoint_dir: str | None = None  # where checkpoints go (chimera.runtime.checkpoint); made absolute by check()
    checkpoint_every: int = 0  # save after every K-th step (0: only with --checkpoint-dir, then at the last step)
    resume: str | None = None  # a checkpoint directory (or the root of --checkpoint-dir: its latest checkpoint)
    max_restarts: int = 0  # Ray: restart from the last checkpoint after a lost worker, at most this often
    debug_kill_in_save: int | None = None  # fault injection: rank 0 kills itself while writing this step's checkpoint


@dataclass(frozen=True)
class ProfilingConfig:
    """Timelines: per-action events, Nsight, single-byte payloads."""

    profile: bool = False
    profile_steps: tuple[int, ...] = ()
    nsys: bool = False
    comm_payload: str = "full"
    memory: bool = False  # account the bytes each worker holds; the step's peak goes into its record


_SECTIONS = {"model": ModelConfig, "schedule": ScheduleConfig, "training": TrainingConfig,
             "profiling": ProfilingConfig}
#: flat names (the command line's ``dest``) -> (section, field); the other fields keep their own names
_RENAMED = {"model": ("model", "name"), "model_overrides": ("model", "overrides"), "schedule": ("schedule", "name")}
FLAT: dict[str, tuple[str, str]] = {
    **{f.name: (sec, f.name) for sec, cls in _SECTIONS.items() for f in dataclasses.fields(cls)
       if f.name != "name" and f.name != "overrides"},
    **_RENAMED,
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs, in sections; identical on the driver and every worker."""

    model: ModelConfig = field(default_factory=ModelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    @staticmethod
    def from_flags(**flat: Any) -> TrainConfig:
        """A config from the command line's names (``model``, ``stages``, ``lr``, ``profile``...)."""
        return TrainConfig().with_flags(**flat)

    def with_flags(self, **flat: Any) -> TrainConfig:
        """A copy with fields set by their command-line names."""
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            if name not in FLAT:
                raise TypeError(f"unknown training option {name!r}; known: {', '.join(sorted(FLAT))}")
            sec, fld = FLAT[name]
            by_section.setdefault(sec, {})[fld] = value
        return dataclasses.replace(self, **{sec: dataclasses.replace(getattr(self, sec), **kw)
                                            for sec, kw in by_section.items()})

    def profiles(self, step: int) -> bool:
        """Whether ``step`` records timeline events (``--profile``; all steps unless ``--profile-steps``)."""
        p = self.profiling
        return p.profile and (not p.profile_steps or step in p.profile_steps)

    def worker_threads(self, world: int) -> int:
        """Torch threads of one worker: ``--threads``, else the machine's cores shared among the ``world`` workers."""
        return self.training.threads or max(1, (os.cpu_count() or 1) // max(1, world))

    @property
    def is_training_result(self) -> bool:
        """False in single-byte mode: messages and allreduces carry one byte, the numbers are not training."""
        return self.profiling.comm_payload == "full"

    @property
    def run_name(self) -> str:
        """``{model}_{schedule}_{D}stages_{workers}gpus_microbs{B}_acc{K}``: the name of the run's profile files."""
        s = self.schedule
        acc = max(1, s.micro_batches // s.stages)
        return (f"{self.model.name}_{s.name}_{s.stages}stages_{s.stages * s.data_parallel}gpus_"
                f"microbs{s.micro_batch_size}_acc{acc}")

    def preset_chain(self) -> LayerChain:
        """The chain of the preset ``model.name`` (vocabulary from the corpus' tokenizer); ConfigError if none."""
        return _preset_chain(self.model)

    def check(self, chain: LayerChain | None = None, data: Any = None) -> Job:
        """Validate every field once; return the :class:`Job` the workers run. Raises :class:`ConfigError`.

        ``chain``/``data``: a user's model and data instead of the preset named by ``model.name``.
        """
        _check_fields(self)
        if self.training.memory_per_worker == "device":
            from chimera.plan.fit import device_budget

            return device_budget(self).check(chain, data)
        if chain is None and self.schedule.name == "auto":
            chain = self.preset_chain()  # auto simulates with the model's costs
        sched, cfg, choice = resolve_schedule(self, chain)  # cfg: self, or for auto the config of the chosen schedule
        s = cfg.schedule
        if chain is None:
            chain = self.preset_chain()
        elif data is None and chain.data is None:
            raise ConfigError(f"{chain.name} has no dataset of its own: pass data (a function (step, micro-batch, "
                              "data-parallel rank) -> (inputs, labels), or a dataset with such a get())")
        check_memory(cfg, chain, sched)
        prediction = None
        if cfg.model.partition == "planned":
            from chimera.plan.auto import planned_partition

            try:
                stage_layers, prediction = planned_partition(cfg, chain, sched)
            except ValueError as e:
                raise ConfigError(f"--partition planned: {e}") from None
        else:
            try:
                stage_layers = partition(chain, sched.stages, partition_method(cfg.model.partition))
            except ConfigError:
                raise
            except ValueError as e:
                raise ConfigError(f"--partition {cfg.model.partition}: {e}") from None
        unit = int(s.micro_batch_size * sched.microbatch_scale)
        try:
            boundaries = chain.boundaries(unit)
        except ChainError as e:
            raise ConfigError(str(e)) from None
        from chimera.plan.fit import fit_budget

        cfg, lowered = fit_budget(cfg, chain, sched, stage_layers, unit)
        from chimera.runtime.checkpoint import check_checkpoints

        return check_checkpoints(Job(cfg, chain, data, validate(lowered), stage_layers, boundaries, prediction,
                                      choice))


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


#: fields whose flag is not ``--`` + the name with dashes
_FLAGS = {("model", "name"): "--model", ("schedule", "name"): "--schedule", ("model", "overrides"): "model overrides",
          ("training", "timeout_s"): "--timeout", ("profiling", "memory"): "--profile-memory",
          ("training", "amp"): "--no-amp"}


def flag_of(section: str, name: str) -> str:
    """The command-line flag of a config field (``("training", "timeout_s")`` -> ``--timeout``)."""
    return _FLAGS.get((section, name), "--" + name.replace("_", "-"))


def _check_types(cfg: TrainConfig) -> None:
    """Every field has its declared type (a value from Python, or an argparse quirk such as ``--steps=--``)."""
    for sec, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value = getattr(getattr(cfg, sec), f.name)
            if not type_ok(value, hints[f.name]):
                want = str(hints[f.name]).replace("typing.", "").replace("collections.abc.", "")
                raise ConfigError(f"{flag_of(sec, f.name)} must be of type {want}, got {value!r}")


def _check_fields(cfg: TrainConfig) -> None:
    """Every field that can be checked on its own; messages name the flag and what to change."""
    _check_types(cfg)
    s, t, p = cfg.schedule, cfg.training, cfg.profiling
    _need(s.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {s.micro_batch_size}")
    _need(s.mode in CHIMERA_MODES, f"--mode must be one of {', '.join(CHIMERA_MODES)}, got {s.mode!r}")
    _need(s.mode != "halving" or s.micro_batch_size % 2 == 0,
          f"--mode halving trains on halves of every micro-batch: --micro-batch-size must be even, got "
          f"{s.micro_batch_size}")
    _need(t.steps >= 1, f"--steps must be >= 1, got {t.steps}")
    _need(t.device in ("cpu", "cuda"), f"--device must be 'cpu' or 'cuda', got {t.device!r}")
    _need(t.optimizer in OPTIMIZERS, f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {t.optimizer!r}")
    _need(t.lr > 0, f"--lr must be > 0, got {t.lr}")
    _need(math.isfinite(t.lr), f"--lr must be finite, got {t.lr}")
    _need(t.weight_decay >= 0 and math.isfinite(t.weight_decay),
          f"--weight-decay must be a finite number >= 0, got {t.weight_decay}")
    _need(t.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {t.warmup_steps}")
    _need(t.lr_schedule in LR_SCHEDULES,
          f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {t.lr_schedule!r}")
    _need(0 < t.timeout_s <= 7 * 86400, f"--timeout must be > 0 seconds and at most a week, got {t.timeout_s}")
    _need(t.clip_grad >= 0 and math.isfinite(t.clip_grad),
          f"--clip-grad must be a finite number >= 0 (0 disables clipping), got {t.clip_grad}")
    _need(t.threads is None or t.threads >= 1, f"--threads must be >= 1, got {t.threads}")
    _need(t.python_gc in PYTHON_GC, f"--python-gc must be one of {', '.join(PYTHON_GC)}, got {t.python_gc!r}")
    unknown = [p for p in t.offload.split(",") if p.strip() not in OFFLOAD_POLICIES]
    _need(t.offload == "auto" or not unknown,
          f"--offload must be one of {', '.join((*OFFLOAD_POLICIES, 'auto'))}, or a comma list with one of "
          f"{', '.join(OFFLOAD_POLICIES)} per stage (e.g. everything,optimizer,none,none for 4 stages); "
          f"got {t.offload!r}: {', '.join(map(repr, unknown))} unknown")
    _need(t.prefetch >= 0, f"--prefetch must be >= 0 compute actions, got {t.prefetch}")
    _need(t.offload_pack >= 0, f"--offload-pack must be >= 0 layers (0: whole stages), got {t.offload_pack}")
    _need(t.offload_pack == 0 or t.offload == "auto" or "everything" in t.offload,
          f"--offload-pack {t.offload_pack} swaps weights in packs: give --offload everything (for some stage) or "
          f"auto, got --offload {t.offload}")
    _need(t.offload != "auto" or t.memory_per_worker is not None,
          "--offload auto chooses the least offload that fits --memory-per-worker: give that budget too")
    _need(all(p.strip() in ("none", "optimizer") for p in t.offload.split(",")) or t.device == "cpu",
          f"--offload {t.offload} sums offloaded gradients over host buffers, which NCCL cannot do yet: use --offload "
          "optimizer on --device cuda")
    if t.memory_per_worker not in (None, "device"):
        from chimera.plan.memory import parse_bytes

        try:
            parse_bytes(t.memory_per_worker)
        except ValueError as e:
            raise ConfigError(f"--memory-per-worker: {e}") from None
    _need(t.checkpoint_every >= 0, f"--checkpoint-every must be >= 0 steps, got {t.checkpoint_every}")
    _need(t.checkpoint_every == 0 or t.checkpoint_dir is not None,
          "--checkpoint-every needs --checkpoint-dir DIR (where the checkpoints go)")
    _need(t.max_restarts >= 0, f"--max-restarts must be >= 0, got {t.max_restarts}")
    _need(t.max_restarts == 0 or t.checkpoint_dir is not None,
          "--max-restarts restarts from the last checkpoint: add --checkpoint-dir DIR and --checkpoint-every K")
    if t.checkpoint_dir is not None:
        writable_path(t.checkpoint_dir, "--checkpoint-dir", directory=True)
    _need(p.comm_payload in PAYLOADS, f"--comm-payload must be one of {', '.join(PAYLOADS)}, got {p.comm_payload!r}")
    bad = [x for x in p.profile_steps if not 0 <= x < t.steps]
    _need(not bad, f"--profile-steps {bad} are outside 0..{t.steps - 1}; raise --steps or pick other steps")


def _preset_chain(m: ModelConfig) -> LayerChain:
    """The preset's chain; with a tokenized corpus its vocabulary is the tokenizer's (so every process builds the
    same model) and the corpus must be able to feed ``seq_len``."""
    model = _build(m, dict(m.overrides))
    path = resolve_corpus(m.corpus)
    if path is None or model.family not in ("bert", "gpt2"):
        return model
    try:
        info = load_info(path, model.family)
        note = check_fit(info, model.seq_len)  # type: ignore[attr-defined]
    except CorpusError as e:
        raise ConfigError(f"--corpus: {e}") from None
    if note:
        warnings.warn(note, stacklevel=1)  # one location: shown once per process
    vocab = m.overrides.get("vocab_size", info.vocab_size)
    if vocab != info.vocab_size:
        raise ConfigError(f"model override vocab_size={vocab} contradicts the {info.family} tokenizer of "
                          f"--corpus {m.corpus} ({info.vocab_size} tokens); drop the override")
    return _build(m, {**m.overrides, "vocab_size": vocab})


def _build(m: ModelConfig, overrides: dict[str, Any]) -> LayerChain:
    try:
        return build_model(m.name, seq_len=m.seq_len, corpus=m.corpus, **overrides)
    except ValueError as e:
        raise ConfigError(f"--model: {e}") from None


__all__ = ["CHIMERA_MODES", "ConfigError", "Job", "ModelConfig", "ProfilingConfig", "ScheduleConfig", "TrainConfig",
           "TrainingConfig"]

"""The one training configuration, its checks, and the plan every worker derives from it.

Usage::

    cfg = TrainConfig(model="bert-tiny", schedule="chimera", stages=2, micro_batches=4)
    cfg.check()                      # raises ConfigError with what to change, before any actor starts
    plan = cfg.plan()                # model, lowered schedule, layers of every stage
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from chimera.data import CorpusError, CorpusInfo, load_info, resolve_corpus
from chimera.data.pretrain import check_fit
from chimera.models import LayeredModel, build_model, partition
from chimera.optim import OPTIMIZERS
from chimera.optim import SCHEDULES as LR_SCHEDULES
from chimera.schedule import Schedule, ScheduleConfigError, build_schedule, lower, validate

PLACEMENTS = ("pack", "spread", "stage-pairs")


class ConfigError(ValueError):
    """An invalid training configuration; the message says what to change."""


@dataclass(frozen=True)
class Plan:
    """What every worker derives from the config: the model, the lowered schedule, stage → layers."""

    model: LayeredModel
    schedule: Schedule
    stage_layers: list[list[int]]

    @property
    def world_size(self) -> int:
        return self.schedule.workers * self.schedule.data_parallel


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; identical on the driver and every worker."""

    model: str = "bert-mini"
    schedule: str = "chimera"
    stages: int = 4
    micro_batches: int = 4
    micro_batch_size: int = 4
    data_parallel: int = 1
    steps: int = 10
    device: str = "cpu"
    seed: int = 1234
    seq_len: int | None = 64
    corpus: str = "sample"  # "sample" (shipped Wikipedia extract), "synthetic" (random tokens) or a corpus path
    chunks: int = 2
    mode: str = "direct"
    partition: str = "uniform"
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
    profile: bool = False
    profile_steps: tuple[int, ...] = ()
    nsys: bool = False
    comm_payload: str = "full"
    check_replicas: bool = False
    # launching (used by the driver only)
    address: str | None = None  # None: start a local Ray on loopback; "auto" or host:port: join a cluster
    placement: str = "pack"
    pre_cmd: tuple[str, ...] = ()  # shell commands run once on every node before training
    env: tuple[str, ...] = ()  # KEY=VALUE for the workers (NCCL_*/GLOO_* of the driver are passed on anyway)
    ship_code: bool | None = None  # ship chimera's code with runtime_env (default: when joining a cluster)
    connect_timeout_s: float = 60.0  # joining the cluster, reserving resources
    model_overrides: dict[str, Any] = field(default_factory=dict)
    debug_stall: tuple[int, float] | None = None  # (worker rank, seconds): fault injection for timeout tests

    def profiles(self, step: int) -> bool:
        """Whether ``step`` records timeline events (``--profile``; all steps unless ``--profile-steps``)."""
        return self.profile and (not self.profile_steps or step in self.profile_steps)

    @property
    def is_training_result(self) -> bool:
        """False in single-byte mode: messages and allreduces carry one byte, the numbers are not training."""
        return self.comm_payload == "full"

    def replace(self, **kw: Any) -> TrainConfig:
        return dataclasses.replace(self, **kw)

    @cached_property
    def _model(self) -> LayeredModel:
        model = self._build_model(self.model_overrides)
        info = self._corpus_info(model.family)
        if info is None:
            return model
        # the vocabulary comes from the corpus' tokenizer, so driver, workers and reference build the same model
        vocab = self.model_overrides.get("vocab_size", info.vocab_size)
        if vocab != info.vocab_size:
            raise ConfigError(f"model override vocab_size={vocab} contradicts the {info.family} tokenizer of "
                              f"--corpus {self.corpus} ({info.vocab_size} tokens); drop the override")
        return self._build_model(self.model_overrides | {"vocab_size": vocab})

    def _build_model(self, overrides: dict[str, Any]) -> LayeredModel:
        try:
            return build_model(self.model, seq_len=self.seq_len, **overrides)
        except ValueError as e:
            raise ConfigError(f"--model: {e}") from None

    def _corpus_info(self, family: str) -> CorpusInfo | None:
        """The tokenized corpus this run reads (None: synthetic data); raises ConfigError with the fix."""
        path = resolve_corpus(self.corpus)
        if path is None or family not in ("bert", "gpt2"):
            return None
        try:
            return load_info(path, family)
        except CorpusError as e:
            raise ConfigError(f"--corpus: {e}") from None

    def check(self) -> Plan:
        """Validate every field; return the plan. Raises :class:`ConfigError` naming what to change."""
        if self.micro_batch_size < 1:
            raise ConfigError(f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.clip_grad < 0:
            raise ConfigError(f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.comm_payload not in ("full", "single-byte"):
            raise ConfigError(f"--comm-payload must be 'full' or 'single-byte', got {self.comm_payload!r}")
        bad = [s for s in self.profile_steps if not 0 <= s < self.steps]
        if bad:
            raise ConfigError(f"--profile-steps {bad} are outside 0..{self.steps - 1}; raise --steps or pick other steps")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        bad_env = [e for e in self.env if "=" not in e or not e.split("=", 1)[0]]
        if bad_env:
            raise ConfigError(f"--env takes KEY=VALUE, got {bad_env[0]!r}")
        if self.mode != "direct":
            raise ConfigError(
                f"--mode {self.mode}: the runtime executes Chimera with direct concatenation; forward doubling and "
                "backward halving are available to the simulator and planner (chimera schedule simulate --mode ...)"
            )
        try:
            sched = build_schedule(self.schedule, self.stages, self.micro_batches, chunks=self.chunks,
                                   mode=self.mode, data_parallel=self.data_parallel)
        except ScheduleConfigError as e:
            raise ConfigError(str(e)) from None
        model = self._model
        info = self._corpus_info(model.family)
        if info is not None:
            try:
                note = check_fit(info, model.seq_len)
            except CorpusError as e:
                raise ConfigError(f"--corpus: {e}") from None
            if note:
                warnings.warn(note, stacklevel=1)  # one location: shown once per process
        try:
            stage_layers = partition(model, sched.stages, _partition_method(self.partition))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return Plan(model, validate(lower(sched)), stage_layers)

    def plan(self) -> Plan:
        return self.check()

    @property
    def run_name(self) -> str:
        """``{model}_{schedule}_{D}stages_{workers}gpus_microbs{B}_acc{K}`` as in the seed's profiles."""
        acc = max(1, self.micro_batches // self.stages)
        return (f"{self.model}_{self.schedule}_{self.stages}stages_{self.stages * self.data_parallel}gpus_"
                f"microbs{self.micro_batch_size}_acc{acc}")


def _partition_method(text: str) -> str | list[int]:
    if text in ("uniform", "params"):
        return text
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--partition must be 'uniform', 'params' or layer counts like '2,2,1,1', got {text!r}") from None


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The training flags shared by ``scripts/prof_steps_ray.py`` and ``chimera train``."""
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="preset: bert-tiny/mini/base/large/48, gpt2-tiny/small/1.3b")
    p.add_argument("--schedule", default=d.schedule, help="chimera, 1f1b, gpipe or interleaved")
    p.add_argument("--stages", "-D", type=int, default=d.stages, help="pipeline depth D")
    p.add_argument("--micro-batches", "-N", type=int, default=d.micro_batches, help="micro-batches per step N")
    p.add_argument("--micro-batch-size", "-B", type=int, default=d.micro_batch_size, help="samples per micro-batch")
    p.add_argument("--data-parallel", "-W", type=int, default=d.data_parallel, help="data-parallel width W")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps")
    p.add_argument("--device", default=d.device, choices=("cpu", "cuda"))
    p.add_argument("--seed", type=int, default=d.seed, help="same seed: same weights and data for every schedule")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="sequence length")
    p.add_argument("--corpus", default=d.corpus,
                   help="'sample' (small Wikipedia extract shipped with chimera), 'synthetic' (random tokens), or a "
                        "corpus prepared with `chimera data prepare` and `chimera data tokenizer`")
    p.add_argument("--chunks", type=int, default=d.chunks, help="interleaved: stages per worker v")
    p.add_argument("--partition", default=d.partition, help="uniform, params or layers per stage '2,2,1,1'")
    p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=LR_SCHEDULES)
    p.add_argument("--clip-grad", type=float, default=d.clip_grad, help="global grad-norm clip (0: off)")
    p.add_argument("--recompute", action="store_true", help="recompute activations in the backward pass")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="no bf16 autocast on GPU")
    p.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s,
                   help="seconds any blocking wait may take before the run fails")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    p.add_argument("--profile", action="store_true", help="record per-action timeline events and write "
                   "profiles/NAME.{trace.json,png,pdf,json}")
    p.add_argument("--profile-steps", type=_steps, default=(), help="steps to record, e.g. 5,6,7 (default: all)")
    p.add_argument("--nsys", action="store_true", help="run the workers under Nsight Systems (nsys on PATH)")
    p.add_argument("--comm-payload", default="full", choices=("full", "single-byte"),
                   help="single-byte: every message/allreduce carries 1 byte (compute-only timelines; not training)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto' or host:port); default: start a local Ray on loopback")
    p.add_argument("--placement", default=d.placement, choices=PLACEMENTS,
                   help="pack: neighbours share a node; spread: round-robin; stage-pairs: pairs (0,1),(2,3).. per node")
    p.add_argument("--pre-cmd", action="append", default=[], help="shell command run once on every node first "
                   "(repeatable)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the workers, e.g. "
                   "NCCL_SOCKET_IFNAME=eth0 (repeatable)")
    p.add_argument("--ship-code", dest="ship_code", action="store_true", default=None,
                   help="ship chimera's code to the workers with runtime_env (default when --address is given)")
    p.add_argument("--no-ship-code", dest="ship_code", action="store_false")
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float, default=d.connect_timeout_s,
                   help="seconds to join the Ray cluster and reserve the workers' resources")
    p.add_argument("--check-replicas", action="store_true",
                   help="after every step, verify that all replicas of each stage are bitwise identical")


def _steps(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step numbers like 5,6,7, got {text!r}") from None


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    kw = {k: v for k, v in vars(ns).items() if k in names}
    for key in ("pre_cmd", "env"):
        kw[key] = tuple(kw.get(key) or ())
    return TrainConfig(**kw)

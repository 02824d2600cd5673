"""The training request in sections. Data only: every field is declared once here (type, default, unit, choices,
help); the command line, the config file and the checks are generated from these declarations.

    cfg = TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=4)   # flat names, as the flags
    cfg.schedule.stages                                                           # 2
    cfg.given                                                                     # {'model', 'stages', 'micro_batches'}

Options of the Ray launcher (address, placement, restarts) belong to the Ray layer (``ray_launch.config``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chimera.config.fields import FieldInfo, option, section_fields


@dataclass(frozen=True)
class ModelSection:
    """What to train: a preset or your own chain, and its data."""

    name: str = option("bert-mini", "preset model", flag="--model", registry="model")
    chain: str | None = option(None, "your own model instead of a preset: 'pkg.module:factory', a function returning "
                               "a LayerChain or (chain, data)")
    seq_len: int | None = option(64, "sequence length of the transformer presets", unit="tokens", minimum=1)
    corpus: str = option("sample", "'sample' (a small Wikipedia extract shipped with chimera), 'synthetic' (random "
                         "tokens), or a corpus made with `chimera data prepare` and `chimera data tokenizer`")
    vocab_shards: int = option(1, "GPT-2 presets: split the token embedding and the LM head by vocabulary into this "
                               "many layers each (shard j of both tied), so that weights streamed in packs "
                               "(--offload-pack) need only 1/K of the vocabulary's rows on the device; --offload auto splits by "
                               "itself when nothing fits unsplit, unless this is given", minimum=1)
    overrides: Mapping[str, Any] = option(factory=dict, help="fields of the preset's model config to change "
                                          "(e.g. num_blocks)", cli=False)


@dataclass(frozen=True)
class ScheduleSection:
    """How to pipeline: the schedule, depth D, micro-batches N of B samples, width W, the split into stages."""

    name: str = option("chimera", "pipeline schedule, or auto (simulate every schedule with the model's profile and "
                       "train the fastest that fits; the choice and why are printed)", flag="--schedule",
                       registry="schedule")
    stages: int = option(4, "pipeline depth D (workers per pipeline)", short="-D", minimum=1)
    micro_batches: int = option(4, "micro-batches per step and pipeline group N", short="-N", minimum=1)
    micro_batch_size: int = option(4, "samples per micro-batch B", unit="samples", short="-B", minimum=1)
    data_parallel: int = option(1, "data-parallel width W (pipeline groups)", short="-W", minimum=1)
    chunks: int = option(2, "interleaved: stages per worker v", minimum=1)
    mode: str = option("direct", "Chimera with N > D: direct concatenation, forward doubling (two micro-batches per "
                       "forward slot; pair with --recompute) or backward halving (backward on half micro-batches)",
                       registry="mode")
    split_backward: bool = option(False, "run every backward as its input-gradient part I and weight-gradient part "
                                  "W (Chimera: W fills its bubbles; zero-bubble schedules always split)")
    schedule_file: str | None = option(None, "train this compute-only schedule: chimera's JSON (chimera schedule show "
                                       "--format json) or CSV, or a torch.distributed.pipelining CSV; validated first")
    partition: str = option("planned", "the split into stages: planned (profile briefly, then the split with the "
                            "least simulated step), uniform, params, or layers per stage like 2,2,1,1")
    plan: str | None = option(None, "train a plan: a file from chimera plan, or auto (profile briefly, then plan "
                              "what the other flags leave open for --stages x --data-parallel workers)")


@dataclass(frozen=True)
class TrainingSection:
    """Optimisation and how the workers run."""

    steps: int = option(10, "training steps", unit="steps", minimum=1)
    seed: int = option(1234, "same seed: same weights and data for every schedule")
    device: str = option("cpu", "where the workers compute", choices=("cpu", "cuda"))
    optimizer: str = option("lamb", "lamb (apex FusedLAMB on GPU when installed, else pytorch_optimizer's Lamb), "
                            "adamw (torch's fused kernel), or sgd", registry="optimizer")
    lr: float = option(1e-3, "learning rate (after warm-up)")
    weight_decay: float = option(0.01, "decoupled weight decay", minimum=0)
    warmup_steps: int = option(0, "steps of linear learning-rate warm-up", unit="steps", minimum=0)
    lr_schedule: str = option("constant", "learning rate after warm-up", registry="lr_schedule")
    clip_grad: float = option(1.0, "clip the global gradient norm to this (0: no clipping)", minimum=0)
    recompute: bool = option(False, "recompute activations in the backward pass instead of keeping them")
    amp: bool = option(True, "bf16 autocast on GPU (--no-amp: full precision)")
    timeout_s: float = option(120.0, "the longest any blocking wait may take before the run fails, naming the "
                              "worker, the action and the micro-batch", unit="seconds", flag="--timeout",
                              minimum=0.001, maximum=7 * 86400)
    threads: int | None = option(None, "torch threads per worker (default: this machine's cores / workers)",
                                 minimum=1, maximum=1024)
    python_gc: str = option("step", "step: freeze the heap after set-up and collect garbage after every step, never "
                            "inside one (a full collection pauses a worker ~0.2 s); auto: Python's own collector",
                            choices=("step", "auto"))
    shard_optimizer: bool = option(False, "ZeRO-1: split each stage's optimizer state among the ranks holding a "
                                   "replica of it (both Chimera pipes, every data-parallel group); each steps the "
                                   "parameters it owns and sends them to the others; the same training bit for bit")
    post_validate: bool = option(False, "update each stage as soon as its gradients are complete and start the "
                                 "next step without waiting for the global gradient norm; the next step's first "
                                 "update checks it and, where clipping engages or it is not finite, rolls the "
                                 "updates back exactly, redoes them clipped (or skips the step: a non-finite norm "
                                 "leaves the weights and optimizer state as they were) and runs that next step "
                                 "again. Costs a copy of each stage's weights, optimizer state and gradients; "
                                 "checkpoints land on validated steps")
    p2p: str = option("auto", "how activations and gradients move between CPU workers: auto (through shared memory "
                      "between processes on one Linux x86-64 host, messages up to 256 KiB; gloo otherwise) or gloo "
                      "(always gloo's TCP)", choices=("auto", "gloo"))
    p2p_spin_s: float = option(0.01, "shared-memory messages: a waiting receive polls for its message this long, "
                               "yielding its core to any other runnable thread between polls, before it sleeps (a "
                               "wake-up from sleep costs tens of microseconds, more on a virtual machine; a core left "
                               "idle halts); 0: sleep at once", unit="seconds", flag="--p2p-spin", minimum=0,
                               maximum=60)
    cpu_affinity: str = option("auto", "CPU workers: auto pins each worker's threads to cores of its own where the "
                               "host's workers x --threads fill its usable cores (round robin by rank, so pipeline "
                               "neighbours compute on different cores); off leaves placement to the kernel",
                               choices=("auto", "off"))
    check_replicas: bool = option(False, "after every step, verify that all replicas of each stage are bitwise "
                                  "identical")
    debug_stall: tuple[int, float] | None = option(None, "fault injection: (worker rank, seconds) to stall",
                                                   cli=False)


@dataclass(frozen=True)
class MemorySection:
    """What a worker may hold, and what lives in host memory instead."""

    memory_per_worker: str | None = option(None, "device memory per worker, e.g. 16GiB, or 'device' (the GPU's "
                                           "free memory; on CPU this machine's available memory / workers): the "
                                           "planner's limit, checked before the run and after every step")
    offload: str = option("none", "keep in host memory the optimizer state (optimizer), also the gradients "
                          "(optimizer+gradients), also the weights, swapped in before use (everything); a comma list "
                          "gives one per stage; auto: the least per stage that fits --memory-per-worker",
                          registry="offload")
    prefetch: int = option(1, "weights offloaded: swap a stage's weights in this many compute actions ahead",
                           unit="actions", minimum=0)
    offload_pack: int = option(0, "weights offloaded: swap them in packs of this many layers inside each forward "
                               "and backward (two packs on the device at once; 0: whole stages)", unit="layers",
                               minimum=0)


@dataclass(frozen=True)
class ProfilingSection:
    """Timelines: per-action events, Nsight, single-byte payloads, memory accounting; metrics to TensorBoard."""

    profile: bool = option(False, "record per-action timeline events and write the run's trace, plots and summary")
    profile_steps: tuple[int, ...] = option((), "steps to record, e.g. 5,6,7 (default: all)")
    nsys: bool = option(False, "run the workers under Nsight Systems (nsys on PATH)")
    comm_payload: str = option("full", "single-byte: every message and gradient sum carries one byte (compute-only "
                               "timelines; not a training result)", choices=("full", "single-byte"))
    profile_memory: bool = option(False, "account the bytes every worker holds (parameters, gradients, optimizer "
                                  "state, stashed activations, messages) and report each step's peak")
    tensorboard: bool = option(False, "also write every step's metrics as TensorBoard scalars, under the run "
                               "directory's tensorboard/ (needs the tensorboard package: pip install "
                               "'chimera[tensorboard]')")


@dataclass(frozen=True)
class CheckpointSection:
    """Checkpoints: where, how often, how many kept, and where to resume from."""

    dir: str | None = option(None, "save checkpoints here (one directory per saved step)")
    every: int = option(0, "save after every K-th step (0: only after the last step); needs --checkpoint-dir",
                        unit="steps", minimum=0)
    keep_last: int = option(0, "keep only the K newest complete checkpoints (0: keep all)", minimum=0)
    resume: str | None = option(None, "continue from a checkpoint: a --checkpoint-dir (its newest complete "
                                "checkpoint) or one step's directory in it; another D, W or schedule re-partitions")
    debug_kill_in_save: int | None = option(None, "fault injection: rank 0 kills itself while writing this step's "
                                            "checkpoint", cli=False)


SECTIONS: dict[str, type] = {"model": ModelSection, "schedule": ScheduleSection, "training": TrainingSection,
                             "memory": MemorySection, "profiling": ProfilingSection, "checkpoint": CheckpointSection}
#: fields whose flat name (keyword argument, flag destination) is not their own name
RENAMED: dict[str, dict[str, str]] = {"model": {"name": "model", "overrides": "model_overrides"},
                                      "schedule": {"name": "schedule"},
                                      "checkpoint": {"dir": "checkpoint_dir", "every": "checkpoint_every"}}


def all_fields() -> list[FieldInfo]:
    """Every field of every section, in declaration order."""
    return [f for sec, cls in SECTIONS.items() for f in section_fields(sec, cls, RENAMED.get(sec, {}))]


#: flat name -> its field
FIELDS: dict[str, FieldInfo] = {f.flat: f for f in all_fields()}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run asks for, in sections. ``given``: the flat names the user set (flags, file or
    keyword arguments), which ``--plan auto`` keeps as they are."""

    model: ModelSection = field(default_factory=ModelSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    memory: MemorySection = field(default_factory=MemorySection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    given: frozenset[str] = field(default=frozenset(), compare=False)

    @staticmethod
    def from_flags(**flat: Any) -> TrainConfig:
        """A config from flat names (``model``, ``stages``, ``lr``, ``profile``...); the rest default."""
        return TrainConfig().with_flags(**flat)

    def with_flags(self, **flat: Any) -> TrainConfig:
        """A copy with fields set by their flat names (they join ``given``). TypeError names an unknown one."""
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            if name not in FIELDS:
                raise TypeError(f"unknown training option {name!r}; known: {', '.join(sorted(FIELDS))}")
            f = FIELDS[name]
            by_section.setdefault(f.section, {})[f.name] = value
        changed = {sec: dataclasses.replace(getattr(self, sec), **kw) for sec, kw in by_section.items()}
        return dataclasses.replace(self, **changed, given=self.given | frozenset(flat))

    def value(self, flat: str) -> Any:
        """The value of a field by its flat name."""
        f = FIELDS[flat]
        return getattr(getattr(self, f.section), f.name)

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name."""
        return {name: self.value(name) for name in FIELDS}

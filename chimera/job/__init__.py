"""The Job: what the compiler decided and every worker runs. Typed decisions only, never the request: the workers
re-parse and re-derive nothing.

    job = chimera.compile.compile_job(cfg)          # the only way to make one from a request
    job.schedule, job.stage_layers, job.offload     # the lowered schedule, the split, the per-stage offload policy
    job.run.steps, job.memory_budget                # run options, budgets in bytes
    job.describe()                                  # everything but the model's and data's code, as plain data

It travels to the workers as it is (pickled with cloudpickle where it holds a user's functions).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from chimera.data import PipelineDataset, Units, as_dataset
from chimera.models import LayerChain, TensorSpec
from chimera.offload.policy import Offload
from chimera.schedule import Schedule
from chimera.schedule.io import to_dict


@dataclass(frozen=True)
class RunOptions:
    """How the workers train: optimisation and the runtime's behaviour."""

    steps: int
    seed: int
    device: str
    optimizer: str
    lr: float
    weight_decay: float
    warmup_steps: int
    lr_schedule: str
    clip_grad: float
    recompute: bool
    amp: bool
    timeout_s: float
    threads: int  # torch threads per worker
    python_gc: str
    check_replicas: bool = False
    comm_payload: str = "full"
    debug_stall: tuple[int, float] | None = None
    post_validate: bool = False  # per-stage updates, validated (rolled back and redone) at the end of the step
    p2p: str = "auto"  # auto: same-host messages on CPU through shared memory (chimera.util.shm); gloo: gloo's TCP
    cpu_affinity: str = "auto"  # auto: CPU workers that fill their host's cores each pinned to their own (round robin)
    p2p_spin_s: float = 0.01  # shared memory: how long a waiting receive polls before it sleeps (0: at once)

    @property
    def is_training_result(self) -> bool:
        """False in single-byte mode: messages and gradient sums carry one byte, the numbers are not training."""
        return self.comm_payload == "full"


@dataclass(frozen=True)
class TimelineOptions:
    """What the workers record: timeline events (which steps), Nsight, memory accounting; and whether the launcher
    also writes the metrics as TensorBoard scalars."""

    profile: bool = False
    steps: tuple[int, ...] = ()
    nsys: bool = False
    memory: bool = False
    tensorboard: bool = False

    def records(self, step: int) -> bool:
        """Whether ``step`` records timeline events (all steps unless ``steps`` names some)."""
        return self.profile and (not self.steps or step in self.steps)


@dataclass(frozen=True)
class CheckpointOptions:
    """Where checkpoints go, how often, how many are kept; fault injection for the interrupted-write test."""

    dir: str | None = None
    every: int = 0
    keep_last: int = 0
    debug_kill_in_save: int | None = None


@dataclass(frozen=True)
class OptimizerShards:
    """ZeRO-1 (``--shard-optimizer``): every parameter of a stage held by more than one rank has one owner in the
    stage's group (``Schedule.stage_group``), which alone keeps its optimizer state, steps it and sends the new
    values to the group; a stage held by one rank is not in ``owners`` (that rank keeps all of its state).

    Attributes:
        owners: stage -> ``(name, bytes, owner)`` for each of its parameters (``layer{i}.{param}``, the first name of
            a parameter shared within the stage, in the stage module's order): its bytes and the owning global rank.
    """

    owners: dict[int, tuple[tuple[str, int, int], ...]]

    def owned_bytes(self, rank: int, stage: int) -> int:
        """Parameter bytes of ``stage`` whose optimizer state ``rank`` keeps."""
        return sum(n for _, n, r in self.owners.get(stage, ()) if r == rank)

    def per_worker(self, schedule: Schedule) -> list[dict[int, int]]:
        """For every worker of one data-parallel group, each sharded stage it holds -> the most parameter bytes of it
        whose state one of that worker's copies (one per group) owns: what the memory model prices."""
        d = schedule.workers
        return [{s: max(self.owned_bytes(g * d + w, s) for g in range(schedule.data_parallel))
                 for _, s in schedule.stages_of(w) if s in self.owners} for w in range(d)]


@dataclass(frozen=True)
class Layout:
    """How the model is pipelined: the schedule's name and options, D, N, B, W."""

    schedule: str
    stages: int
    micro_batches: int
    micro_batch_size: int
    data_parallel: int
    mode: str = "direct"
    chunks: int = 2
    split_backward: bool = False

    @property
    def samples(self) -> int:
        """Samples per step: N x B x W."""
        return self.micro_batches * self.micro_batch_size * self.data_parallel


@dataclass(frozen=True)
class Prediction:
    """What the planner predicts for the job, and from which profile."""

    step_s: float
    source: str
    bubble: float | None = None
    peak_memory_bytes: int | None = None
    trust: str = ""  # why the prediction may be off (the plan file's ``trust``; "": nothing known)


@dataclass(frozen=True)
class ResumePoint:
    """A verified checkpoint to start from: its directory, the step to run next and its manifest."""

    path: str
    step: int
    manifest: dict[str, Any]
    same_layout: bool  # same schedule, D, W, N and B: every rank gets its own RNG state back


@dataclass(frozen=True)
class Job:
    """A compiled job (module docstring).

    Attributes:
        name: the run's name, ``{model}_{schedule}_{D}stages_{workers}workers_microbs{B}_acc{K}``.
        model: the model's name.
        chain: the model; data: the user's data (a function or dataset), or None for the chain's own.
        schedule: the lowered, validated schedule (one data-parallel group's lists).
        layout: the schedule's name and options, D, N, B, W.
        stage_layers: layer indices of every stage; boundaries: the tensors flowing into every layer for one unit.
        unit_size: samples per schedule unit (B, or B/2 under backward halving).
        offload: the offload policy of every stage; memory_budget: bytes a worker may hold (None: no budget).
        run, timeline, checkpoint: run options.
        prediction: the planner's prediction when it planned; decisions: what the compiler chose and why.
        resume: the checkpoint the workers start from.
        shards: which rank keeps each parameter's optimizer state (``--shard-optimizer``), or None (every replica).
        source: the fingerprint and source root of the chimera that compiled the job
            (:mod:`chimera.util.source`), which every worker checks against its own before it starts; None: unchecked.
    """

    name: str
    model: str
    chain: LayerChain
    data: Any
    schedule: Schedule
    layout: Layout
    stage_layers: list[list[int]]
    boundaries: list[list[TensorSpec]]
    unit_size: int
    run: RunOptions
    offload: Offload = field(default_factory=Offload)
    memory_budget: int | None = None
    timeline: TimelineOptions = field(default_factory=TimelineOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    prediction: Prediction | None = None
    decisions: tuple[str, ...] = ()
    resume: ResumePoint | None = None
    shards: OptimizerShards | None = None
    source: tuple[str, str] | None = None

    @property
    def first_step(self) -> int:
        """The step the run starts at: 0, or the step after the resumed checkpoint."""
        return self.resume.step if self.resume is not None else 0

    @property
    def world_size(self) -> int:
        return self.schedule.workers * self.schedule.data_parallel

    def stage_inputs(self, stage: int) -> list[TensorSpec]:
        """The tensors ``stage`` receives from the previous stage (for one unit)."""
        return self.boundaries[self.stage_layers[stage][0]]

    def dataset(self) -> PipelineDataset:
        """The micro-batches this job trains on, addressed by (step, micro-batch, data-parallel rank)."""
        if self.data is not None:
            return as_dataset(self.data)
        lay = self.layout
        return self.chain.dataset(lay.micro_batch_size, self.run.seed, lay.micro_batches, lay.data_parallel)

    def units(self) -> Units:
        """The dataset as the schedule's units (halves of micro-batches under backward halving)."""
        return Units(self.dataset(), int(1 / self.schedule.microbatch_scale))

    def describe(self) -> dict[str, Any]:
        """Every decision as plain data (the model and data by name): two jobs built alike describe alike."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "chain":
                v = {"name": v.name, "layers": v.num_layers, "type": type(v).__name__}
            elif f.name == "data":
                v = None if v is None else getattr(v, "__qualname__", type(v).__qualname__)
            elif f.name == "schedule":
                v = to_dict(v)
            elif f.name == "boundaries":
                v = [[(tuple(t.shape), str(t.dtype), t.requires_grad) for t in b] for b in v]
            elif f.name == "offload":
                v = v.describe()
            elif dataclasses.is_dataclass(v):
                v = dataclasses.asdict(v)
            out[f.name] = v
        return out

"""The planner's candidates and what it makes of them: a configuration (:class:`Candidate`), its prediction or the
reason it cannot run (:class:`Evaluated`), and the ranked result (:class:`PlanResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chimera.offload.policy import Offload
from chimera.schedule.registry import ScheduleSpec
from chimera.schedule.registry import get as schedule_spec


@dataclass(frozen=True)
class Candidate:
    """One configuration: schedule (and Chimera mode), D, W, B, N, recomputation."""

    schedule: str
    mode: str
    stages: int
    data_parallel: int
    micro_batch_size: int
    micro_batches: int
    recompute: bool
    chunks: int = 2
    offload: Offload = Offload()
    split_backward: bool = False
    shard_optimizer: bool = False  # ZeRO-1: each stage's optimizer state split over its replicas

    @property
    def spec(self) -> ScheduleSpec:
        return schedule_spec(self.schedule)

    @property
    def options(self) -> dict[str, Any]:
        """The schedule's build options."""
        return {"mode": self.mode, "chunks": self.chunks, "split_backward": self.split_backward}

    @property
    def unit(self) -> int:
        """Samples per schedule unit (halving trains on half micro-batches)."""
        return self.micro_batch_size // 2 if self.mode == "halving" else self.micro_batch_size

    def flags(self) -> dict[str, Any]:
        """The training flags of this candidate (``TrainConfig.with_flags``); with weights offloaded also how they
        move (``prefetch``, ``offload_pack``), which the memory it was priced with depends on; sharded,
        ``shard_optimizer``."""
        flags: dict[str, Any] = {"schedule": self.schedule, "mode": self.mode, "stages": self.stages,
                 "data_parallel": self.data_parallel, "micro_batch_size": self.micro_batch_size,
                 "micro_batches": self.micro_batches, "recompute": self.recompute, "chunks": self.chunks,
                 "offload": self.offload.text, "split_backward": self.split_backward}
        moving = self.offload.moving
        if moving:  # the planner gives every stage the same prefetch and pack size
            flags.update(prefetch=moving.prefetch, offload_pack=moving.pack)
        if self.shard_optimizer:
            flags["shard_optimizer"] = True
        return flags

    @property
    def parts(self) -> int:
        """Stages the model is cut into: D, or D x chunks where a worker holds several per pipe."""
        return self.spec.parts(self.stages, self.options)

    @property
    def label(self) -> str:
        spec = self.spec
        name = f"{self.schedule}-{self.mode}" if spec.modes else self.schedule
        split = self.split_backward and not spec.split_only
        return name + ("+split" if split else "") + ("+recompute" if self.recompute else "") + (
            f"+offload-{self.offload.text}" if self.offload.optimizer else "")


@dataclass(frozen=True)
class Evaluated:
    """A candidate with its prediction, or the reason it cannot run."""

    candidate: Candidate
    step_s: float | None = None
    samples_per_s: float | None = None
    bubble: float | None = None
    peak_memory: int | None = None
    partition: list[int] | None = None
    reason: str | None = None
    exact: bool = False  # simulated on the lowered schedule (else the first pass's estimate)


@dataclass
class PlanResult:
    """Ranked feasible candidates (best first), infeasible ones with reasons, and how many were pruned."""

    ranked: list[Evaluated]
    infeasible: list[Evaluated]
    pruned: int = 0
    inputs: dict[str, Any] = field(default_factory=dict)

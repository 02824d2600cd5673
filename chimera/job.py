"""The validated job: what :meth:`chimera.config.TrainConfig.check` returns and every worker runs.

It travels to the workers as it is (pickled with cloudpickle where it holds a user's functions), so no worker
validates or derives anything again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chimera.data import PipelineDataset, Units, as_dataset
from chimera.models import LayerChain, TensorSpec
from chimera.schedule import Schedule

if TYPE_CHECKING:
    from chimera.config import TrainConfig


@dataclass(frozen=True)
class Job:
    """A checked configuration with everything derived from it.

    Attributes:
        cfg: the configuration it was checked from.
        chain: the model.
        data: the user's data (a function or dataset), or None for the chain's own dataset.
        schedule: the lowered, validated schedule.
        stage_layers: layer indices of every stage.
        boundaries: ``boundaries[b]``: the tensors flowing into layer ``b`` for one schedule unit
            (``unit_size`` samples).
        prediction: the planner's prediction for this job (step seconds, bubble, peak memory) when it planned
            the partition.
        schedule_choice: where the schedule came from when not named: why ``--schedule auto`` chose it, or the
            ``--schedule-file``.
    """

    cfg: TrainConfig
    chain: LayerChain
    data: Any
    schedule: Schedule
    stage_layers: list[list[int]]
    boundaries: list[list[TensorSpec]]
    prediction: dict[str, Any] | None = None
    schedule_choice: str | None = None
    resume: Any = None  # chimera.runtime.checkpoint.ResumePoint: the checkpoint the workers start from

    @property
    def first_step(self) -> int:
        """The step the run starts at: 0, or the step after the resumed checkpoint."""
        return self.resume.step if self.resume is not None else 0

    @property
    def world_size(self) -> int:
        return self.schedule.workers * self.schedule.data_parallel

    @property
    def unit_size(self) -> int:
        """Samples per schedule unit: the micro-batch size, or half of it under backward halving."""
        return int(self.cfg.schedule.micro_batch_size * self.schedule.microbatch_scale)

    def stage_inputs(self, stage: int) -> list[TensorSpec]:
        """The tensors ``stage`` receives from the previous stage (for one unit)."""
        return self.boundaries[self.stage_layers[stage][0]]

    def dataset(self) -> PipelineDataset:
        """The micro-batches this job trains on, addressed by (step, micro-batch, data-parallel rank)."""
        if self.data is not None:
            return as_dataset(self.data)
        s = self.cfg.schedule
        return self.chain.dataset(s.micro_batch_size, self.cfg.training.seed, s.micro_batches, s.data_parallel)

    def units(self) -> Units:
        """The dataset as the schedule's units (halves of micro-batches under backward halving)."""
        return Units(self.dataset(), int(1 / self.schedule.microbatch_scale))

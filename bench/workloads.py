"""Workloads of ``bench/vs_torch_pipelining.py``: one model, D, N, B and the data both systems read.

Both systems build their stages from chimera's layered models (``build_model`` + ``partition`` +
``build_stage``) with the same seed, and read the same micro-batches from chimera's synthetic datasets, so
the work per step is identical. A schedule that places two stages per rank (torch's Interleaved1F1B and
DualPipeV) splits the same model into 2·D parts; for the delay model the 2·D blocks sleep tf/2 each, so the
work per rank stays the same. A workload with ``split="planned"`` (``bert-d2-n4-planned``) runs the planner's
balanced split instead of the uniform one, the same on both systems (``Workload.with_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from chimera.models import LayerChain, build_model
from chimera.plan.partition import partition, plan_partition
from chimera.plan.profiles import cached_profile
from chimera.schedule import build_schedule


@dataclass(frozen=True)
class Workload:
    """One row group of the table: model, pipeline depth D, micro-batches N, micro-batch size B."""

    name: str
    model: str
    stages: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    tf: float | None = None  # delay model: forward seconds per stage (input gradient tf, weight gradient tf)
    seed: int = 1234
    split: str = "uniform"  # or "planned": the planner's balanced split, the same on both systems
    planned: tuple[tuple[int, tuple[int, ...]], ...] = ()  # stage count -> layers per stage (``with_plan``)

    @property
    def is_delay(self) -> bool:
        return self.model == "delay"

    @property
    def optimizer(self) -> str:
        return "sgd" if self.is_delay else "adamw"

    def overrides(self, parts: int) -> dict[str, Any]:
        """Model overrides for a split into ``parts`` stages (the delay model gets one block per stage, its sleeps
        for a micro-batch of ``micro_batch_size`` rows: half of one sleeps half)."""
        if not self.is_delay:
            return {}
        assert self.tf is not None
        return {"num_blocks": parts, "fwd_s": self.tf * self.stages / parts, "rows": self.micro_batch_size}

    def build(self, parts: int) -> LayerChain:
        """The layered model as split into ``parts`` stages."""
        return build_model(self.model, seq_len=self.seq_len, **self.overrides(parts))

    def layers(self, model: LayerChain, parts: int) -> list[list[int]]:
        """Layer indices of each of ``parts`` stages: uniform, or the planned split of ``with_plan``."""
        if self.split == "uniform":
            return partition(model, parts)
        sizes = dict(self.planned).get(parts)
        if sizes is None:
            raise ValueError(f"{self.name}: no planned split into {parts} stages; call with_plan({parts}) first")
        return partition(model, parts, list(sizes))

    def sizes(self, parts: int) -> str | None:
        """The planned split into ``parts`` stages as a ``--partition`` value (None: uniform)."""
        return None if self.split == "uniform" else ",".join(map(str, dict(self.planned)[parts]))

    def with_plan(self, *parts: int) -> Workload:
        """This workload with the planner's split into each of ``parts`` stages: the model is profiled once
        (one thread per worker, as many profiling processes at once as the D workers, micro-batch size B;
        kept in ``profiles/``), and each split minimises the simulated 1F1B step over that many stages, so
        both systems and every schedule of a stage count run the same balanced split."""
        if self.split == "uniform":
            return self
        model = self.build(self.stages)
        prof = cached_profile(model, [self.micro_batch_size], "cpu", 1, self.stages)
        planned = tuple((k, tuple(plan_partition(prof, build_schedule("1f1b", k, self.micro_batches),
                                                 self.micro_batch_size, False, self.optimizer).sizes))
                        for k in sorted(set(parts)))
        return replace(self, planned=planned)

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The whole step's mini-batch for torch.pp: first-stage positional inputs and one packed target.

        Micro-batch ``m`` of step ``step`` is exactly what chimera's workers read for (step, m, dp 0);
        torch.pp splits the concatenation along dim 0 back into the same N micro-batches.
        """
        model = self.build(self.stages)
        ds = model.dataset(self.micro_batch_size, self.seed)
        ins, tgts = [], []
        for m in range(self.micro_batches):
            inputs, labels = ds.get(step, m, 0)
            ins.append(tuple(inputs[k] for k in input_keys(model)))
            tgts.append(pack_target(model, labels))
        args = tuple(torch.cat([x[i] for x in ins]) for i in range(len(ins[0])))
        return args, torch.cat(tgts)


def input_keys(model: LayerChain) -> tuple[str, ...]:
    """Names of the first stage's positional inputs under torch.pp."""
    return ("x",) if model.family == "delay" else ("input_ids", "token_type_ids", "attention_mask")


def pack_target(model: LayerChain, labels: dict[str, torch.Tensor]) -> torch.Tensor:
    """Labels as one tensor with the batch in dim 0 (torch.pp splits ``target`` along dim 0)."""
    if model.family == "delay":
        return labels["y"]
    return torch.cat([labels["labels"], labels["next_sentence_label"][:, None]], dim=1)


def unpack_target(model: LayerChain, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """The chain's labels of a packed target (inverse of :func:`pack_target`)."""
    if model.family == "delay":
        return {"y": target}
    return {"labels": target[:, :-1], "next_sentence_label": target[:, -1]}


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("delay-d4-n4", "delay", 4, 4, 2, 64, tf=0.05),
        Workload("delay-d4-n8", "delay", 4, 8, 2, 64, tf=0.05),
        Workload("delay-d4-n16", "delay", 4, 16, 2, 64, tf=0.05),
        Workload("delay-d8-n8", "delay", 8, 8, 2, 64, tf=0.05),
        Workload("delay-d8-n16", "delay", 8, 16, 2, 64, tf=0.05),
        Workload("delay-d8-n32", "delay", 8, 32, 2, 64, tf=0.05),
        Workload("bert-d2-n4", "bert-tiny", 2, 4, 4, 64),
        Workload("bert-d2-n8", "bert-tiny", 2, 8, 4, 64),
        Workload("bert-d2-n4-planned", "bert-tiny", 2, 4, 4, 64, split="planned"),
        Workload("bert-d2-n8-planned", "bert-tiny", 2, 8, 4, 64, split="planned"),
        Workload("bert-d4-n8", "bert-tiny", 4, 8, 4, 64),
    ]
}

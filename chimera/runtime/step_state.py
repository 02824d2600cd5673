"""What one worker holds during one step, under typed keys; made fresh every step, so nothing leaks across steps.

* ``held[res][Slot(pipe, stage, microbatch)]``: the activations held for a later action, by the resource of the
  kinds table that holds them (:data:`~chimera.schedule.kinds.ACTIVATION_MEMORY`): ``stash`` (what a backward
  needs from its forward, :class:`Stashed`) and ``wkeep`` (what a weight-gradient backward W needs from its
  input-gradient backward I, :class:`Kept`); each held value lists its tensors for the memory ledger.
* ``inbox[Msg]``: tensors that arrived for this worker (received, or handed over by a stage on the same worker).
* ``outbox[Msg]``: tensors waiting for their send action.
* ``data[(pipe, microbatch)]``: a micro-batch's (inputs, labels) loaded ahead of its forward, while the worker waited
  for a message (:meth:`~chimera.runtime.compute.StageCompute.load_ahead`).

:class:`~chimera.schedule.kinds.Msg` is the same key the schedule's send/receive actions carry, so what the
forward of stage s produces is what the receive of stage s+1 delivers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from chimera.microbatch import tensors
from chimera.schedule.kinds import ACTIVATION_MEMORY, Msg, Res


class Slot(NamedTuple):
    """One micro-batch of one stage replica."""

    pipe: str
    stage: int
    microbatch: int


@dataclass
class Stashed:
    """What the backward of one micro-batch needs.

    ``inputs``: the stage's input tensors (leaves whose ``.grad`` becomes the gradient to send; empty on the first
    stage); ``output``: the forward's output with its autograd graph, or None when the backward recomputes it;
    ``data``: the micro-batch's (inputs, labels) on the first and last stage; ``rng``: the unit's seed the forward
    ran under (recomputation runs under it again, so dropout draws the same masks); ``saved``: the tensors autograd saved
    for the backward (collected only when memory is accounted).
    """

    inputs: tuple[torch.Tensor, ...]
    output: Any
    data: tuple[Any, Any] | None
    rng: int | None = None
    saved: list[torch.Tensor] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds (the memory ledger counts their storages)."""
        out = list(self.inputs) + list(self.saved) + tensors(self.output)
        return out + (tensors(self.data) if self.data is not None else [])


@dataclass
class Kept:
    """What the weight-gradient part (W) of a split backward needs from its input-gradient part (I).

    ``groups``: torch's parameter groups (the autograd nodes where the weights' gradients branch off, and the
    gradients that reached them); None when the stage's inputs need no gradient (the first stage), and W then
    differentiates ``outputs`` with ``grads`` with respect to the weights. ``saved``: the stash's saved tensors
    (memory accounting).
    """

    groups: list[dict[str, Any]] | None
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor] | None
    saved: list[torch.Tensor] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds (the memory ledger counts their storages)."""
        out = self.saved + self.outputs + list(self.grads or [])
        return out + [t for g in self.groups or [] for ts in g.get("grads") or [] for t in ts or () if t is not None]


@dataclass
class StepState:
    """The per-step state of one worker (module docstring)."""

    step: int
    device: torch.device
    held: dict[Res, dict[Slot, Any]] = field(default_factory=lambda: {res: {} for res in ACTIVATION_MEMORY})
    inbox: dict[Msg, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    outbox: dict[Msg, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    data: dict[tuple[str, int], tuple[Any, Any]] = field(default_factory=dict)  # (pipe, micro-batch) loaded ahead
    loss_sum: torch.Tensor | None = None  # float64, from the last stage's first loss (a step edge makes no tensor)
    loss_count: int = 0
    grad_norm: float = 0.0

    @property
    def stash(self) -> dict[Slot, Stashed]:
        return self.held[Res.STASH]

    @property
    def wkeep(self) -> dict[Slot, Kept]:
        return self.held[Res.WKEEP]

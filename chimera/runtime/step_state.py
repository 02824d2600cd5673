"""What one worker holds during one step, under typed keys; made fresh every step, so nothing leaks across steps.

* ``stash[Slot(pipe, stage, microbatch)]``: what a backward needs from its forward (:class:`Stashed`).
* ``wkeep[Slot]``: what a weight-gradient backward (W) needs from its input-gradient backward (I) (:class:`Kept`).
* ``inbox[Msg]``: tensors that arrived for this worker (received, or handed over by a stage on the same worker).
* ``outbox[Msg]``: tensors waiting for their send action.

:class:`~chimera.schedule.kinds.Msg` is the same key the schedule's send/receive actions carry, so what the
forward of stage s produces is what the receive of stage s+1 delivers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from chimera.schedule.kinds import Msg


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
    ``data``: the micro-batch's (inputs, labels) on the first and last stage; ``rng``: the RNG state the forward
    ran under (recomputation replays it, so dropout draws the same masks); ``saved``: the tensors autograd saved
    for the backward (collected only when memory is accounted).
    """

    inputs: tuple[torch.Tensor, ...]
    output: Any
    data: tuple[Any, Any] | None
    rng: Any = None
    saved: list[torch.Tensor] = field(default_factory=list)


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


@dataclass
class StepState:
    """The per-step state of one worker (module docstring)."""

    step: int
    device: torch.device
    stash: dict[Slot, Stashed] = field(default_factory=dict)
    wkeep: dict[Slot, Kept] = field(default_factory=dict)
    inbox: dict[Msg, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    outbox: dict[Msg, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    loss_sum: torch.Tensor | None = None
    loss_count: int = 0
    grad_norm: float = 0.0

    def __post_init__(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)

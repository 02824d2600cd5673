"""A delay model for measuring schedules: forward sleeps ``fwd_s``, backward ``bwd_factor * fwd_s`` per block.

Sleeping instead of computing lets D workers share 2 cores without fighting over them, so measured
bubbles reflect the schedule and the runtime, not CPU contention. With ``num_blocks = D`` and the uniform
partition every stage holds exactly one sleeping block (the embedding and head are tiny linear layers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chimera.models.base import LayeredModel, TensorSpec, layer_generator


@dataclass
class DelayConfig:
    """Shape and timing of the delay model."""

    num_blocks: int = 4
    hidden_size: int = 16
    fwd_s: float = 0.05
    bwd_factor: float = 2.0
    max_position_embeddings: int = 1 << 30  # no positions: any --seq-len is accepted and ignored


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.bwd_s)
        return grad, None, None


class _Embed(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.proj = nn.Linear(h, h)

    def forward(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        return (self.proj(inputs["x"]),)


class _Block(nn.Module):
    def __init__(self, h: int, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.proj = nn.Linear(h, h)
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (_Sleep.apply(self.proj(x), self.fwd_s, self.bwd_s),)


class _Head(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, labels: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(self.proj(x), labels["y"])


class DelayModel(LayeredModel):
    """Embedding, ``num_blocks`` sleeping blocks, regression head; activations are ``[B, hidden]``."""

    family = "delay"

    @property
    def num_blocks(self) -> int:
        return int(self.config.num_blocks)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return 0

    def _make_layer(self, index: int) -> nn.Module:
        h = self.hidden_size
        if index == 0:
            return _Embed(h)
        if index == self.num_layers - 1:
            return _Head(h)
        return _Block(h, self.config.fwd_s, self.config.fwd_s * self.config.bwd_factor)

    def _init_layer(self, index: int, layer: nn.Module, seed: int) -> None:
        gen = layer_generator(seed, index)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0.0, 0.1, generator=gen)

    def tied_parameters(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        return []

    def activation_spec(self, boundary: int, micro_batch_size: int, seq_len: int) -> list[TensorSpec]:
        return [TensorSpec((micro_batch_size, self.hidden_size), torch.float32, True)]

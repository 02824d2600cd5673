"""A four-layer MLP for the post-validation tests (``--chain tests.postval_chain:mlp``): the first and the last
layer's weights tied (so the tied gradient sums run), random regression data; ``mlp_inf`` feeds an infinite input to
one micro-batch of step 2 (data-parallel rank 0), which makes that step's gradients not finite; ``mlp_untied`` has no
tie."""

from __future__ import annotations

import torch
from torch import nn

from chimera.data import as_dataset
from chimera.models import LayerChain

WIDTH = 16
POISONED = (2, 1, 0)  # (step, micro-batch, data-parallel rank) of mlp_inf's infinite input


class Block(nn.Module):
    """``lin(tanh(x))`` (the first block: ``lin(x)``)."""

    def __init__(self, first: bool = False) -> None:
        super().__init__()
        self.first = first
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x if self.first else torch.tanh(x))


def _first() -> Block:
    return Block(first=True)


def _data(poison: tuple[int, int, int] | None):  # noqa: ANN202
    def factory(micro_batch_size: int, seed: int, microbatches: int, data_parallel: int):  # noqa: ANN202, ARG001
        def get(step: int, microbatch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + microbatch * 101 + rank)
            x = torch.randn(micro_batch_size, WIDTH, generator=g)
            y = torch.randn(micro_batch_size, WIDTH, generator=g)
            if (step, microbatch, rank) == poison:
                x[0, 0] = float("inf")
            return x, y

        return as_dataset(get)

    return factory


def _chain(poison: tuple[int, int, int] | None) -> LayerChain:
    return LayerChain([_first, Block, Block, Block], loss=nn.functional.mse_loss,
                      example=(torch.zeros(2, WIDTH), torch.zeros(2, WIDTH)),
                      tied=[((0, "lin.weight"), (3, "lin.weight"))], name="postval-mlp", data=_data(poison))


def mlp() -> LayerChain:
    """The MLP with finite data."""
    return _chain(None)


def mlp_untied() -> LayerChain:
    """The MLP without the tie (nothing then holds every worker at a step's end when training does not clip)."""
    return LayerChain([_first, Block, Block, Block], loss=nn.functional.mse_loss,
                      example=(torch.zeros(2, WIDTH), torch.zeros(2, WIDTH)), name="postval-mlp-untied",
                      data=_data(None))


def mlp_inf() -> LayerChain:
    """The MLP with an infinite input at :data:`POISONED`."""
    return _chain(POISONED)

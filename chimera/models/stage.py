"""Pipeline stages: consecutive layers of a :class:`LayerChain` wrapped as one ``nn.Module``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from chimera.models.chain import LayerChain, Loss, as_tuple, call

Acts = tuple[torch.Tensor, ...]


class StageModule(nn.Module):
    """Consecutive layers ``indices`` of a chain with ``num_layers`` layers.

    ``forward(acts, inputs, labels)``: the stage holding layer 0 reads ``inputs`` (``acts`` is ignored, may
    be None); other stages read ``acts``. The stage holding the last layer needs ``labels`` and returns the
    chain's scalar loss; any other stage returns its output as a tuple of tensors.
    """

    def __init__(self, layers: Sequence[nn.Module], indices: Sequence[int], num_layers: int,
                 loss: Loss | None = None) -> None:
        super().__init__()
        indices = list(indices)
        if len(layers) != len(indices) or not indices:
            raise ValueError("StageModule needs one layer per index and at least one layer")
        if indices != list(range(indices[0], indices[0] + len(indices))):
            raise ValueError(f"stage layers must be consecutive, got {indices}")
        if indices[-1] >= num_layers:
            raise ValueError(f"layer {indices[-1]} out of range for a model with {num_layers} layers")
        if indices[-1] == num_layers - 1 and loss is None:
            raise ValueError("the stage holding the last layer needs the chain's loss")
        self.layers = nn.ModuleList(layers)
        self.indices = indices
        self.num_layers = num_layers
        self.loss_fn = loss

    @property
    def is_first(self) -> bool:
        """Whether this stage holds layer 0 (consumes the micro-batch's inputs)."""
        return self.indices[0] == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage holds the last layer (returns the loss)."""
        return self.indices[-1] == self.num_layers - 1

    def forward(self, acts: Acts | None, inputs: Any = None, labels: Any = None) -> Acts | torch.Tensor:
        """Run the stage; returns its output activations, or the loss on the last stage."""
        if self.is_first:
            if inputs is None:
                raise ValueError("the first stage needs `inputs`")
            x: Any = inputs
        elif acts is None:
            raise ValueError(f"stage {self.indices} needs input activations")
        else:
            x = tuple(acts)
        for layer in self.layers:
            x = call(layer, x)
        if not self.is_last:
            return as_tuple(x)
        if labels is None:
            raise ValueError("the last stage needs `labels`")
        assert self.loss_fn is not None
        return self.loss_fn(x, labels)


def build_stage(chain: LayerChain, indices: Sequence[int], seed: int, device: torch.device | str | None = None
                ) -> StageModule:
    """Build the layers ``indices`` of ``chain`` and wrap them as a :class:`StageModule`."""
    return StageModule(chain.build_layers(indices, seed, device=device), indices, chain.num_layers, chain.loss)


class SequentialModel(nn.Module):
    """All layers of a chain in one module: the single-process reference for parity tests."""

    def __init__(self, chain: LayerChain, seed: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.stage = build_stage(chain, range(chain.num_layers), seed, device=device)

    def forward(self, inputs: Any, labels: Any) -> torch.Tensor:
        """Loss of one micro-batch."""
        loss = self.stage(None, inputs=inputs, labels=labels)
        assert isinstance(loss, torch.Tensor)
        return loss

"""Pipeline stages: consecutive layers of a :class:`LayeredModel` wrapped as one ``nn.Module``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from chimera.models.base import LayeredModel

Acts = tuple[torch.Tensor, ...]


class StageModule(nn.Module):
    """Consecutive layers ``indices`` of a model with ``num_layers`` layers.

    ``forward(acts, inputs, labels)``: the stage holding layer 0 reads ``inputs`` (``acts`` is ignored,
    may be None); other stages read ``acts``. The stage holding the last layer needs ``labels`` and
    returns the scalar loss; any other stage returns the output activation tuple.
    """

    def __init__(self, layers: Sequence[nn.Module], indices: Sequence[int], num_layers: int) -> None:
        super().__init__()
        indices = list(indices)
        if len(layers) != len(indices) or not indices:
            raise ValueError("StageModule needs one layer per index and at least one layer")
        if indices != list(range(indices[0], indices[0] + len(indices))):
            raise ValueError(f"stage layers must be consecutive, got {indices}")
        if indices[-1] >= num_layers:
            raise ValueError(f"layer {indices[-1]} out of range for a model with {num_layers} layers")
        self.layers = nn.ModuleList(layers)
        self.indices = indices
        self.num_layers = num_layers

    @property
    def is_first(self) -> bool:
        """Whether this stage holds layer 0 (consumes the input dict)."""
        return self.indices[0] == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage holds the last layer (returns the loss)."""
        return self.indices[-1] == self.num_layers - 1

    def forward(
        self,
        acts: Acts | None,
        inputs: dict[str, torch.Tensor] | None = None,
        labels: dict[str, torch.Tensor] | None = None,
    ) -> Acts | torch.Tensor:
        """Run the stage; returns activations, or the loss on the last stage."""
        layers = list(self.layers)
        if self.is_first:
            if inputs is None:
                raise ValueError("the first stage needs `inputs`")
            acts = layers[0](inputs)
            layers = layers[1:]
        elif acts is None:
            raise ValueError(f"stage {self.indices} needs input activations")
        last = layers[-1] if self.is_last and layers else None
        if last is not None:
            layers = layers[:-1]
        for layer in layers:
            acts = layer(*acts)
        if last is None:
            return acts
        if labels is None:
            raise ValueError("the last stage needs `labels`")
        return last(*acts, labels=labels)


def build_stage(
    model: LayeredModel, indices: Sequence[int], seed: int, device: torch.device | str | None = None
) -> StageModule:
    """Build the layers ``indices`` of ``model`` and wrap them as a :class:`StageModule`."""
    return StageModule(model.build_layers(indices, seed, device=device), indices, model.num_layers)


class SequentialModel(nn.Module):
    """All layers of ``model`` chained in one process: the single-process reference for parity tests."""

    def __init__(self, model: LayeredModel, seed: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.stage = build_stage(model, range(model.num_layers), seed, device=device)

    def forward(self, inputs: dict[str, torch.Tensor], labels: dict[str, torch.Tensor]) -> torch.Tensor:
        """Loss of one micro-batch."""
        loss = self.stage(None, inputs=inputs, labels=labels)
        assert isinstance(loss, torch.Tensor)
        return loss

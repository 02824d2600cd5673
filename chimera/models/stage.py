"""Pipeline stages: consecutive layers of a :class:`LayerChain` wrapped as one ``nn.Module``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from chimera.models.chain import LayerChain, Loss, as_tuple, call, layer_seed

Acts = tuple[torch.Tensor, ...]


class StageModule(nn.Module):
    """Consecutive layers ``indices`` of a chain with ``num_layers`` layers.

    ``forward(acts, inputs, labels, rng)``: the stage holding layer 0 reads ``inputs`` (``acts`` is ignored, may
    be None); other stages read ``acts``. The stage holding the last layer needs ``labels`` and returns the
    chain's scalar loss; any other stage returns its output as a tuple of tensors. ``rng`` (a unit's seed,
    :func:`unit_seed`): every layer that draws random numbers (dropout; the chain's ``draws``) draws them from
    torch's RNG seeded with ``(rng, layer index)`` (the chain's ``seed_index``), the state outside left as it was; so
    a layer's masks depend on the unit, not on the stage that holds the layer or on what ran before it (any
    partition, schedule or recomputation draws the same). ``seeds[i]`` None: layer ``i`` draws nothing and is not
    seeded; a stage none of whose layers draws touches no generator (seeding costs ~12 µs a forward after a sleep).
    """

    def __init__(self, layers: Sequence[nn.Module], indices: Sequence[int], num_layers: int,
                 loss: Loss | None = None, seeds: Sequence[int | None] | None = None) -> None:
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
        self.seeds: list[int | None] = list(indices if seeds is None else seeds)  # seed_index, None: draws nothing
        self.draws = any(s is not None for s in self.seeds)
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

    @property
    def reads_data(self) -> bool:
        """Whether the forward reads the micro-batch's data (the first stage its inputs, the last its labels)."""
        return self.is_first or self.is_last

    def _device(self) -> torch.device:
        # the first parameter found once (a walk over the modules costs ~40 us an action); read on every call: an
        # offloaded stage's weights change device, the parameter stays
        first = self.__dict__.get("_first")
        if first is None:
            first = self.__dict__["_first"] = [next(self.parameters(), None)]
        return first[0].device if first[0] is not None else torch.device("cpu")

    def forward(self, acts: Acts | None, inputs: Any = None, labels: Any = None, rng: int | None = None
                ) -> Acts | torch.Tensor:
        """Run the stage; returns its output activations, or the loss on the last stage."""
        if self.is_first:
            if inputs is None:
                raise ValueError("the first stage needs `inputs`")
            x: Any = inputs
        elif acts is None:
            raise ValueError(f"stage {self.indices} needs input activations")
        else:
            x = tuple(acts)
        if rng is None or not self.draws:
            for layer in self.layers:
                x = call(layer, x)
        else:
            with _seeding(self._device()) as seed:
                for index, layer in zip(self.seeds, self.layers):
                    if index is not None:
                        seed(layer_seed(rng, index))
                    x = call(layer, x)
        if not self.is_last:
            return as_tuple(x)
        if labels is None:
            raise ValueError("the last stage needs `labels`")
        assert self.loss_fn is not None
        return self.loss_fn(x, labels)

    def named_once(self) -> list[tuple[str, nn.Parameter]]:
        """``(layer{i}.{param}, parameter)`` in the module's order, a parameter shared by two layers once (its first
        name): the names the optimizer-sharding pass gives owners and the runtime looks them up by."""
        seen: set[int] = set()
        out = []
        for i, layer in zip(self.indices, self.layers):
            for name, p in layer.named_parameters(remove_duplicate=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"layer{i}.{name}", p))
        return out


def unit_seed(seed: int, step: int, unit: int, rank: int) -> int:
    """The seed of one unit's random draws in one step (``StageModule.forward``'s ``rng``): a function of the run's
    seed, the step, the unit (micro-batch) and the data-parallel rank only."""
    for x in (step, unit, rank):
        seed = layer_seed(seed, x)
    return seed


@contextmanager
def _seeding(device: torch.device) -> Iterator[Callable[[int], None]]:
    """A function that seeds torch's default generators (the CPU's, and ``device``'s when CUDA), their states saved
    once on the way in and restored on the way out (the generators themselves: ``torch.manual_seed`` costs ~100 us,
    this ~2 us)."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(torch.cuda.default_generators[device.index if device.index is not None
                                                  else torch.cuda.current_device()])
    states = [g.get_state() for g in gens]

    def seed(value: int) -> None:
        for g in gens:
            g.manual_seed(value)

    try:
        yield seed
    finally:
        for g, st in zip(gens, states):
            g.set_state(st)


def build_stage(chain: LayerChain, indices: Sequence[int], seed: int, device: torch.device | str | None = None
                ) -> StageModule:
    """Build the layers ``indices`` of ``chain`` and wrap them as a :class:`StageModule`."""
    return StageModule(chain.build_layers(indices, seed, device=device), indices, chain.num_layers, chain.loss,
                       [chain.seed_index(i) if chain.draws(i) else None for i in indices])


class SequentialModel(nn.Module):
    """All layers of a chain in one module: the single-process reference for parity tests."""

    def __init__(self, chain: LayerChain, seed: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.stage = build_stage(chain, range(chain.num_layers), seed, device=device)

    def forward(self, inputs: Any, labels: Any, rng: int | None = None) -> torch.Tensor:
        """Loss of one micro-batch (``rng``: its seed, as ``StageModule.forward``)."""
        loss = self.stage(None, inputs=inputs, labels=labels, rng=rng)
        assert isinstance(loss, torch.Tensor)
        return loss

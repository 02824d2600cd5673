"""Weights in packs (``--offload-pack K``): a stage's weights stream through the device K layers at a time.

A stage whose policy is ``everything`` keeps its weights in the host store; with packs the schedule has no
swap action for it: inside each forward (and a recomputing backward's forward again) a hook before the first
layer of pack j releases pack j-1, waits for pack j and prefetches pack j+1, and the stage's last layer
releases what is left; a backward starts with the last pack in and the one before it prefetched, and the
gradient reaching the input of pack j (a hook registered during the forward) releases pack j and moves on to
pack j-1. So at most two consecutive packs are on the device, and every pack moves once per micro-batch of a
forward or backward: the memory model (``chimera.plan.memory``) and the bytes predicted for a step
(``swap_bytes``) count the same. Gradients leave for the host one parameter at a time as the backward
accumulates them (:class:`chimera.offload.store.HostStore`), so at most one pack's gradients are on the device.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from chimera.microbatch import tensors


class PackSource(Protocol):
    """What a pack stream needs of the host store (:class:`chimera.offload.store.HostStore`)."""

    def home(self, p: nn.Parameter) -> nn.Parameter: ...

    def copy_in(self, params: list[nn.Parameter], ready: Any) -> int: ...

    def release(self, params: list[nn.Parameter]) -> None: ...

    def wait(self, key: Any) -> None: ...


class PackStream:
    """The packs of one stage replica and which of them are on the device (module docstring)."""

    def __init__(self, store: PackSource, key: tuple[str, int], mod: nn.Module, size: int) -> None:
        self.store = store
        self.key = key
        layers = list(mod.layers)  # type: ignore[arg-type]
        self.packs = [list(dict.fromkeys(p for layer in layers[j:j + size] for p in layer.parameters()))
                      for j in range(0, len(layers), size)]
        self.nbytes = [sum(store.home(p).numel() * store.home(p).element_size() for p in ps) for ps in self.packs]
        self.on: set[int] = set()
        self.held = 0
        self.peak = (0, 0)  # (weights, gradients in flight) when their sum was largest
        for j, first in enumerate(layers[::size]):
            first.register_forward_pre_hook(self._entering(j), with_kwargs=True)
        layers[-1].register_forward_hook(lambda *_: self.release_all())

    def _bring(self, j: int) -> None:
        if j not in self.on:
            self.store.copy_in(self.packs[j], (self.key, j))
            self.on.add(j)
            self.held += self.nbytes[j]
            self.note_grad(0)

    def _drop(self, j: int) -> None:
        if j in self.on:
            self.store.release(self.packs[j])
            self.on.discard(j)
            self.held -= self.nbytes[j]

    def _at(self, j: int, step: int) -> None:
        """Pack ``j`` current (waited for), pack ``j + step`` prefetched, every other pack released."""
        for i in sorted(self.on - {j, j + step}):
            self._drop(i)
        self._bring(j)
        self.store.wait((self.key, j))
        if 0 <= j + step < len(self.packs):
            self._bring(j + step)

    def _entering(self, j: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self._at(j, +1)
            if j == 0 or not torch.is_grad_enabled():
                return
            fired: list[bool] = []

            def back(grad: torch.Tensor) -> None:  # pack j's backward is done: on to pack j-1
                if not fired:
                    fired.append(True)
                    self._at(j - 1, -1)

            for t in tensors((args, kwargs)):
                if t.requires_grad:
                    t.register_hook(back)

        return hook

    def start_backward(self) -> None:
        """The last pack in, the one before it prefetched."""
        self._at(len(self.packs) - 1, -1)

    def release_all(self) -> None:
        for j in sorted(self.on):
            self._drop(j)

    def note_grad(self, nbytes: int) -> None:
        """A gradient of ``nbytes`` is on the device now, beside the packs held (it leaves for the host next)."""
        if self.held + nbytes > sum(self.peak):
            self.peak = (self.held, nbytes)

    def take_peak(self) -> tuple[int, int]:
        """(weights, gradients) when the most bytes were held at once since the last call; restarts from what is
        held now."""
        peak, self.peak = self.peak, (self.held, 0)
        return peak

"""The host store: a worker's state kept in host memory instead of on the device (``--offload``).

For every parameter of the worker's stage replicas the store keeps a host copy (pinned on GPU), which is the
current value of the weight: the optimizer steps the host copies (its state lives on the host), and the
gradients, when offloaded, are summed there. The schedule's swap actions (``chimera.offload.lowering.
add_offload``) move data:

* ``SWAP_IN``: host -> device weights of a stage replica (on GPU on a separate copy stream; the stage's next
  F or B waits for the copy's event, so a prefetched swap-in overlaps the compute before it);
* ``SWAP_OUT``: release the device copy of a stage's weights (the host copy is current: nothing moves);
* ``GRAD_OUT``: device -> host gradients, added to the host's sum (the device gradients are freed); with weights
  in packs each gradient already left when the backward accumulated it (a hook on the parameter).

While weights are offloaded, a forward's autograd graph must not keep the device weights alive until the
backward: :meth:`HostStore.pack` turns a saved tensor that lives in a device weight into a reference to that
weight, which the backward resolves against the copy swapped in for it (same values: weights change only in
the optimizer step). On CPU the "device" copies are distinct tensors, so the budget, the bytes moved and the
results are tested on any machine. Without offload no store exists and nothing is copied.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from torch import nn

from chimera.offload.packs import PackStream
from chimera.offload.policy import Offload

StageKey = tuple[str, int]


class WeightRef(NamedTuple):
    """A saved tensor that is (a view of) a device weight: resolved when the backward unpacks it."""

    param: nn.Parameter
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class HostStore:
    """Host copies of one worker's offloaded stage replicas (``modules``: those whose stage's policy offloads)
    and the swaps between them and the device (module docstring)."""

    def __init__(self, modules: dict[StageKey, nn.Module], offload: Offload, device: torch.device) -> None:
        self.offload = offload
        self.device = device
        self.cuda = device.type == "cuda"
        self.params: dict[StageKey, list[nn.Parameter]] = {}
        self.host: dict[int, nn.Parameter] = {}  # id of a device parameter -> its host copy
        for key, mod in modules.items():
            unique = list(dict.fromkeys(mod.parameters()))
            self.params[key] = unique
            for p in unique:
                if id(p) not in self.host:  # built in host memory (weights offloaded): no copy on CPU
                    copy = p.detach().to("cpu", copy=p.device == device)
                    self.host[id(p)] = nn.Parameter(copy.pin_memory() if self.cuda else copy)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready: dict[StageKey, Any] = {}
        self.resident: dict[int, nn.Parameter] = {}  # storage address of a device weight -> its parameter
        self.copies = {id(h) for h in self.host.values()}
        self.moved = 0  # bytes moved between host and device in this step
        for key in self.params:
            if offload.weights_at(key[1]):
                self.swap_out(key)
        self.moved = 0
        # weights in packs: streamed inside the stage's forwards and backwards (chimera.offload.packs); each
        # gradient leaves the device as soon as the backward has accumulated it, so a stage's gradients are never
        # on the device together (GRAD_OUT then finds none left)
        self.packs = {key: PackStream(self, key, mod, offload.at(key[1]).pack) for key, mod in modules.items()
                      if offload.packed_at(key[1])}
        for key, stream in self.packs.items():
            for p in self.params[key]:
                p.register_post_accumulate_grad_hook(self._grad_done(stream))

    def _grad_done(self, stream: PackStream) -> Any:
        def hook(p: nn.Parameter) -> None:
            assert p.grad is not None
            stream.note_grad(p.grad.numel() * p.grad.element_size())
            self._grad_out(p)

        return hook

    def transient_peak(self) -> tuple[int, int]:
        """Device bytes held at once inside compute actions since the last call, then reset: packs of weights, and
        the gradients in flight to the host at that moment."""
        peaks = [stream.take_peak() for stream in self.packs.values()]
        return sum(w for w, _ in peaks), sum(g for _, g in peaks)

    def backward_packs(self, key: StageKey) -> None:
        """Before a backward of ``key``: its last pack in (and the one before it prefetched), if it streams."""
        if key in self.packs:
            self.packs[key].start_backward()

    def release_packs(self, key: StageKey) -> None:
        """After a forward or backward of ``key``: release its packs, if it streams."""
        if key in self.packs:
            self.packs[key].release_all()

    def home(self, p: nn.Parameter) -> nn.Parameter:
        """The host copy of device parameter ``p`` (``p`` itself when its stage keeps it on the device)."""
        return self.host.get(id(p), p)

    def is_host(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the store's host copies."""
        return id(p) in self.copies

    def start_step(self) -> None:
        self.moved = 0

    # -- the swap actions ------------------------------------------------------------------------------
    def swap_in(self, key: StageKey) -> None:
        """Host -> device weights of stage replica ``key`` (into the resident copy, or a new one)."""
        self.copy_in(self.params[key], key)

    def copy_in(self, params: list[nn.Parameter], ready: Any) -> int:
        """Host -> device copies of ``params`` (on GPU on the copy stream, whose event :meth:`wait` with ``ready``
        makes the compute stream wait for); returns the bytes moved."""
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the step may still use the old copy
        moved = 0
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for p in params:
                h = self.host[id(p)]
                if p.data.numel() == 0:
                    p.data = h.detach().to(self.device, non_blocking=True, copy=True)
                    self.resident[p.data.untyped_storage().data_ptr()] = p
                else:
                    p.data.copy_(h.detach(), non_blocking=True)
                moved += h.numel() * h.element_size()
        self.moved += moved
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self.ready[ready] = event
            for p in params:
                p.data.record_stream(torch.cuda.current_stream(self.device))
        return moved

    def wait(self, key: Any) -> None:
        """Make the compute stream wait for the swap-in of ``key`` (GPU; nothing on CPU)."""
        event = self.ready.pop(key, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def swap_out(self, key: StageKey) -> None:
        """Release the device copy of ``key``'s weights (the host copy is current)."""
        self.release(self.params[key])

    def release(self, params: list[nn.Parameter]) -> None:
        """Release the device copies of ``params``."""
        for p in params:
            self.resident.pop(p.data.untyped_storage().data_ptr(), None)
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)

    def grads_out(self, key: StageKey) -> None:
        """Device -> host gradients of ``key``, added to the host's sum; the device gradients are freed."""
        for p in self.params[key]:
            if p.grad is not None:
                self._grad_out(p)

    def _grad_out(self, p: nn.Parameter) -> None:
        """Device -> host gradient of ``p``, added to the host's sum; the device gradient is freed."""
        assert p.grad is not None
        h = self.host[id(p)]
        g = p.grad.detach().to("cpu", copy=True)  # on GPU a synchronous copy: the host adds it next
        if h.grad is None:
            h.grad = g
        else:
            h.grad.add_(g)
        self.moved += g.numel() * g.element_size()
        p.grad = None

    # -- autograd's saved tensors ----------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor | WeightRef:
        """A reference instead of ``t`` when ``t`` lives in a device weight (weights offloaded), else ``t``."""
        try:
            p = self.resident.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
            return t
        if p is None:
            return t
        return WeightRef(p, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    @staticmethod
    def unpack(t: torch.Tensor | WeightRef) -> torch.Tensor:
        """The tensor a backward reads: a referenced weight from its current device copy."""
        if isinstance(t, WeightRef):
            if t.param.data.numel() == 0:
                raise RuntimeError("a backward needs weights that are not on the device: the schedule lacks a "
                                   "SWAP_IN before it")
            return t.param.data.as_strided(t.size, t.stride, t.offset)
        return t

    def held(self) -> list[torch.Tensor]:
        """What the store keeps in host memory: weights and gradient sums."""
        return [t for h in self.host.values() for t in (h, h.grad) if t is not None]

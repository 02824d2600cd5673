"""The data interface the pipeline runtime reads micro-batches through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from chimera.microbatch import split

Batch = dict[str, torch.Tensor]
_M64 = (1 << 64) - 1


@runtime_checkable
class PipelineDataset(Protocol):
    """Micro-batches addressed by ``(step, microbatch, dp_rank)``, deterministic from that address.

    ``get`` returns ``(inputs, labels)``: the first stage reads ``inputs``, the last stage's loss ``labels``.
    Two processes asking for the same address get identical tensors.
    """

    def get(self, step: int, microbatch: int, dp_rank: int) -> tuple[Any, Any]:
        """Inputs and labels of one micro-batch."""
        ...


class FunctionDataset:
    """A function ``fn(step, microbatch, dp_rank) -> (inputs, labels)`` used as a :class:`PipelineDataset`."""

    def __init__(self, fn: Callable[[int, int, int], tuple[Any, Any]]) -> None:
        self.fn = fn

    def get(self, step: int, microbatch: int, dp_rank: int) -> tuple[Any, Any]:
        return self.fn(step, microbatch, dp_rank)


def as_dataset(data: Any) -> PipelineDataset:
    """``data`` as a dataset: an object with ``get(step, microbatch, dp_rank)``, or such a function."""
    if hasattr(data, "get") and callable(data.get):
        return data
    if callable(data):
        return FunctionDataset(data)
    raise TypeError(f"data must be a function (step, micro-batch, data-parallel rank) -> (inputs, labels) or an "
                    f"object with such a get() method, got {type(data).__name__}")


class Units:
    """A step's micro-batches as a schedule's units: with ``parts`` > 1 (backward halving: 2) unit ``u`` is part
    ``u % parts`` (along dim 0) of micro-batch ``u // parts``, so halved schedules train on the same samples."""

    def __init__(self, dataset: PipelineDataset, parts: int = 1) -> None:
        self.dataset = dataset
        self.parts = parts
        self._last: tuple[tuple[int, int, int], list[Any]] | None = None

    def get(self, step: int, unit: int, dp_rank: int) -> tuple[Any, Any]:
        """Inputs and labels of unit ``unit`` of ``step`` on data-parallel rank ``dp_rank``."""
        if self.parts == 1:
            return self.dataset.get(step, unit, dp_rank)
        address = (step, unit // self.parts, dp_rank)
        if self._last is None or self._last[0] != address:
            self._last = (address, split(self.dataset.get(*address), self.parts))
        return self._last[1][unit % self.parts]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """Stable 63-bit hash of integers (independent of Python's hash randomisation)."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (part & _M64))
    return h >> 1


def address_generator(seed: int, step: int, microbatch: int, dp_rank: int) -> torch.Generator:
    """CPU generator seeded from ``(seed, step, microbatch, dp_rank)``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(mix_seed(seed, step, microbatch, dp_rank))
    return gen


class AddressedDataset:
    """Base for datasets that draw each micro-batch from its own address generator."""

    def __init__(self, vocab_size: int, seq_len: int, micro_batch_size: int, seed: int) -> None:
        if micro_batch_size < 1 or seq_len < 1:
            raise ValueError(f"micro_batch_size and seq_len must be >= 1, got {micro_batch_size}, {seq_len}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed

    def _sample(self, gen: torch.Generator) -> tuple[Batch, Batch]:
        raise NotImplementedError

    def get(self, step: int, microbatch: int, dp_rank: int = 0) -> tuple[Batch, Batch]:
        """Inputs and labels of micro-batch ``microbatch`` of ``step`` on data-parallel rank ``dp_rank``."""
        return self._sample(address_generator(self.seed, step, microbatch, dp_rank))

    def inputs(self, step: int, microbatch: int, dp_rank: int = 0) -> Batch:
        """First-stage inputs only."""
        return self.get(step, microbatch, dp_rank)[0]

    def labels(self, step: int, microbatch: int, dp_rank: int = 0) -> Batch:
        """Last-stage labels only."""
        return self.get(step, microbatch, dp_rank)[1]


def permute(index: int, n: int, key: int) -> int:
    """A keyed pseudo-random bijection of ``[0, n)`` evaluated at ``index``, in O(1) memory.

    A 4-round Feistel network on the smallest even bit width that holds ``n``, cycle-walked into range
    (at most ~4 walks on average), so that huge corpora need no stored permutation.
    """
    if not 0 <= index < n:
        raise IndexError(f"index {index} outside [0, {n})")
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    x = index
    while True:
        left, right = x >> half, x & mask
        for r in range(4):
            left, right = right, left ^ (mix_seed(key, r, right) & mask)
        x = (left << half) | right
        if x < n:
            return x

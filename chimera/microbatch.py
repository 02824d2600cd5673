"""Micro-batches as nested values: tensors inside tuples, lists and dicts, with the samples in dim 0.

The runtime joins micro-batches (one message for a forward over several micro-batches), splits them (backward
halving trains on halves of micro-batches) and describes them (shapes on the meta device) with these helpers;
they are the one place that walks such values.

    >>> import torch
    >>> mb = {"x": torch.zeros(4, 3), "y": torch.ones(4)}
    >>> [rows(p) for p in split(mb, 2)]
    [2, 2]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with every tensor ``t`` replaced by ``fn(t)`` (tuples, lists and dicts are walked)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, in walking order."""
    out: list[torch.Tensor] = []
    map_tensors(out.append, value)
    return out


def rows(value: Any) -> int:
    """The number of samples (dim 0) of ``value``; raises ValueError if its tensors disagree."""
    sizes = {t.shape[0] if t.dim() else None for t in tensors(value)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every tensor of a micro-batch needs the samples in dim 0; got leading sizes {sorted(sizes, key=str)}")
    return sizes.pop()


def split(value: Any, parts: int) -> list[Any]:
    """``value`` cut into ``parts`` equal pieces along dim 0 (views, no copy)."""
    n = rows(value)
    if n % parts:
        raise ValueError(f"cannot split a micro-batch of {n} samples into {parts} equal parts")
    size = n // parts
    return [map_tensors(lambda t, i=i: t[i * size:(i + 1) * size], value) for i in range(parts)]


def cat(values: Sequence[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Tuples of tensors joined tensor by tensor along dim 0 (a single tuple is returned as it is)."""
    if len(values) == 1:
        return tuple(values[0])
    return tuple(torch.cat(ts) for ts in zip(*values))


def resized(value: Any, samples: int, device: str | torch.device = "meta") -> Any:
    """Empty tensors shaped like ``value``'s but with ``samples`` rows, on ``device`` (the meta device: no memory)."""
    return map_tensors(lambda t: torch.empty((samples, *t.shape[1:]), dtype=t.dtype, device=device), value)


def repeated(value: Any, samples: int) -> Any:
    """``value`` with ``samples`` rows, cycling through its own rows (real values: token ids and masks stay valid)."""
    n = rows(value)
    index = torch.arange(samples) % n
    return map_tensors(lambda t: t[index.to(t.device)], value)

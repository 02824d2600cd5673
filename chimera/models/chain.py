"""The model contract: an ordered chain of layers, a loss, an example micro-batch and declared tied parameters.

Usage::

    import torch
    from torch import nn
    from chimera.models import LayerChain

    chain = LayerChain(
        [lambda: nn.Linear(32, 64), nn.ReLU, lambda: nn.Linear(64, 10)],
        loss=nn.functional.cross_entropy,
        example=(torch.randn(8, 32), torch.randint(0, 10, (8,))),
    )

Calling convention: layer 0 gets the micro-batch's inputs (a tensor: one argument; a tuple: positional
arguments; a dict: keyword arguments); every later layer gets the previous layer's output (a tuple is
unpacked into positional arguments); ``loss(output of the last layer, labels)`` returns a scalar, the mean over
the micro-batch. Every tensor that flows between layers has the micro-batch's samples in dim 0; the shapes,
dtypes and gradient flags between stages are inferred by running the example on the meta device, so no
particular layout (such as a transformer's ``[B, S, H]``) is assumed.

A layer is a factory (a class or function returning an ``nn.Module``, called with torch's global RNG seeded
from ``(seed, layer index)``, so its default initialisation is the same in every process;
``torch.initial_seed()`` is that seed) or a module (copied into each process as it is). ``tied`` declares
parameters that are one parameter of the model but may sit on different stages, ``((i, "name"), (j,
"name"))``: the second is initialised as a copy of the first and the runtime sums their gradients.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from chimera.microbatch import resized, rows

Tied = tuple[tuple[int, str], tuple[int, str]]
LayerEntry = nn.Module | Callable[[], nn.Module]
Loss = Callable[[Any, Any], torch.Tensor]
#: ``data(micro_batch_size, seed, microbatches, data_parallel)`` -> a dataset addressed by (step, micro-batch, rank)
DataFactory = Callable[[int, int, int, int], Any]

_SEED_MULT = 1000003
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and gradient flag of one tensor that flows between two layers."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def layer_seed(seed: int, index: int) -> int:
    """Stable per-layer seed: depends only on ``(seed, index)``."""
    return (seed * _SEED_MULT + index) & _MASK63


def call(layer: Callable[..., Any], x: Any) -> Any:
    """Apply ``layer`` to ``x`` by the calling convention (tuple: positional, dict: keyword arguments)."""
    if isinstance(x, tuple):
        return layer(*x)
    if isinstance(x, dict):
        return layer(**x)
    return layer(x)


def as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    """A layer's output as the tuple of tensors that travels to the next stage."""
    out = x if isinstance(x, tuple) else (x,)
    if not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"a layer between stages must return a tensor or a tuple of tensors, got {_describe(x)}")
    return out


class ChainError(ValueError):
    """A layer chain that cannot be built or run; the message names the layer and what to change."""


class LayerChain:
    """A model as an ordered list of layers, a loss and an example micro-batch (module docstring)."""

    family = "custom"

    def __init__(self, layers: Sequence[LayerEntry], loss: Loss, example: tuple[Any, Any], *,
                 tied: Sequence[Tied] = (), name: str = "chain", data: DataFactory | None = None) -> None:
        if len(layers) < 1:
            raise ChainError("a layer chain needs at least one layer")
        for i, entry in enumerate(layers):
            if not (isinstance(entry, nn.Module) or callable(entry)):
                raise ChainError(f"layer {i} is a {type(entry).__name__}; give an nn.Module or a function/class "
                                 "that returns one")
        if not (isinstance(example, tuple) and len(example) == 2):
            raise ChainError("example must be one micro-batch as a pair (inputs, labels)")
        rows(example)  # every tensor of the example has the samples in dim 0
        for (li, _), (lj, _) in tied:
            if not (0 <= li < len(layers) and 0 <= lj < len(layers)) or li == lj:
                raise ChainError(f"tied pair between layers {li} and {lj}: both must be different layers of the "
                                 f"{len(layers)} in the chain")
        self.layers = list(layers)
        self.loss = loss
        self.example = example
        self.tied = [tuple(map(tuple, t)) for t in tied]
        self.name = name
        self.data = data
        self._specs: dict[int, list[list[TensorSpec]]] = {}
        self._draws: list[bool] | None = None  # per layer, found by the first inference (draws)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def fingerprint(self) -> str:
        """A short hash of what profiles and checkpoints depend on: the name, every layer's parameter count and the
        shapes between the layers (for one sample)."""
        h = hashlib.sha256()
        h.update(self.name.encode())
        h.update(json.dumps(self.layer_num_params()).encode())
        for specs in self.boundaries(1):
            h.update(json.dumps([[list(s.shape), str(s.dtype), s.requires_grad] for s in specs]).encode())
        return h.hexdigest()[:16]

    def tokens_per_sample(self) -> int | None:
        """Token positions in one sample (padding included): the elements per sample of the example's
        ``input_ids`` (inputs as a dict, as transformers models take them), else of its first integer tensor; None
        when the inputs hold no integer tensor (the samples are not token sequences)."""
        inputs = self.example[0]
        if isinstance(inputs, dict) and isinstance(inputs.get("input_ids"), torch.Tensor):
            found: list[torch.Tensor] = [inputs["input_ids"]]
        else:
            leaves = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (list, tuple)) \
                else [inputs]
            found = [t for t in leaves if isinstance(t, torch.Tensor) and not t.is_floating_point()
                     and not t.is_complex() and t.dtype != torch.bool]
        if not found or found[0].dim() == 0 or found[0].shape[0] == 0:
            return None
        return found[0].numel() // found[0].shape[0]

    def seed_index(self, index: int) -> int:
        """The index whose seed builds layer ``index`` and seeds its random draws (dropout): the layer's own here. A
        chain that splits another chain's layer into parts gives every part the whole layer's index (with the same
        draws), so that both chains start from the same weights and draw the same masks."""
        return index

    def draws(self, index: int) -> bool:
        """Whether layer ``index`` draws random numbers (dropout): it ran, on the example on the meta device, an
        operation tagged ``nondeterministic_seeded`` or one outside torch's own (``aten``, ``prims``), which might,
        or it could not run under the probe (counted as drawing).
        Only such layers are seeded per unit (:class:`~chimera.models.stage.StageModule`): the others draw nothing
        whatever their seed."""
        if self._draws is None:
            self.boundaries(rows(self.example))
        assert self._draws is not None
        return self._draws[index]

    def tied_parameters(self) -> list[Tied]:
        """Pairs ``((layer, param_name), (layer, param_name))`` that are one parameter of the model."""
        return list(self.tied)  # type: ignore[arg-type]

    def dataset(self, micro_batch_size: int, seed: int, microbatches: int = 1, data_parallel: int = 1) -> Any:
        """The chain's own dataset (presets have one); a chain without one needs data from the caller."""
        if self.data is None:
            raise ChainError(f"{self.name} has no dataset of its own; pass data= (a function or dataset addressed by "
                             "(step, micro-batch, data-parallel rank))")
        return self.data(micro_batch_size, seed, microbatches, data_parallel)

    # -- building ------------------------------------------------------------------------------------
    def _build(self, index: int, seed: int, meta: bool = False) -> nn.Module:
        entry = self.layers[index]
        if isinstance(entry, nn.Module):
            layer = copy.deepcopy(entry)
            return layer.to("meta") if meta else layer
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, self.seed_index(index)))
            if meta:
                with torch.device("meta"):
                    layer = entry()
            else:
                layer = entry()
        if not isinstance(layer, nn.Module):
            raise ChainError(f"layer {index} of {self.name}: its factory returned a {type(layer).__name__}, not an "
                             "nn.Module")
        return layer

    def build_layers(self, indices: Sequence[int], seed: int, device: torch.device | str | None = None
                     ) -> list[nn.Module]:
        """Build exactly the layers ``indices``, deterministically from ``seed``, then move them to ``device``.

        Tied parameters are one ``Parameter`` when both ends are built here, and equal otherwise.
        """
        indices = list(indices)
        for i in indices:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"layer index {i} out of range [0, {self.num_layers}) for {self.name}")
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate layer indices in {indices}")
        meta = device is not None and torch.device(device).type == "meta"
        layers = {i: self._build(i, seed, meta) for i in indices}
        with torch.no_grad():
            for (li, pi), (lj, pj) in self.tied:
                if lj in layers and not meta:
                    source = layers[li] if li in layers else self._build(li, seed)
                    layers[lj].get_parameter(pj).copy_(source.get_parameter(pi))
        if device is not None and not meta:
            for layer in layers.values():
                layer.to(device)
        # tie after moving: .to() may replace Parameter objects
        for (li, pi), (lj, pj) in self.tied:
            if li in layers and lj in layers:
                _set_parameter(layers[lj], pj, layers[li].get_parameter(pi))
        return [layers[i] for i in indices]

    def layer_num_params(self) -> list[int]:
        """Parameter count of every layer (tied parameters counted in each layer that holds them)."""
        return [sum(p.numel() for p in self._build(i, 0, meta=True).parameters()) for i in range(self.num_layers)]

    # -- shapes between layers -------------------------------------------------------------------------
    def boundaries(self, samples: int) -> list[list[TensorSpec]]:
        """``out[b]``: the tensors flowing into layer ``b`` (``1 <= b < num_layers``) for micro-batches of
        ``samples`` samples; ``out[0]`` is empty. Inferred by running the example on the meta device, which also
        checks that the chain runs end to end (a :class:`ChainError` names the failing layer)."""
        if samples not in self._specs:
            self._specs[samples] = self._infer(samples)
        return self._specs[samples]

    def _infer(self, samples: int) -> list[list[TensorSpec]]:
        inputs, labels = resized(self.example, samples)
        out: list[list[TensorSpec]] = [[]]
        draws: list[bool] | None = [] if self._draws is None else None  # found once, by the first inference
        x = inputs
        for i in range(self.num_layers):
            layer = self._build(i, 0, meta=True)
            try:
                if draws is None:
                    x = call(layer, x)
                else:
                    x, drew = _probed(layer, x)
                    draws.append(drew)
            except Exception as e:
                raise ChainError(f"layer {i} of {self.name} ({type(layer).__name__}) fails on the example micro-batch "
                                 f"({'its inputs' if i == 0 else 'the output of layer ' + str(i - 1)}: "
                                 f"{_describe(x)}): {type(e).__name__}: {e}") from None
            if i == self.num_layers - 1:
                break
            try:
                acts = as_tuple(x)
            except TypeError as e:
                raise ChainError(f"layer {i} of {self.name}: {e}") from None
            bad = [tuple(t.shape) for t in acts if t.dim() == 0 or t.shape[0] != samples]
            if bad:
                raise ChainError(f"layer {i} of {self.name} returns tensors of shape {bad} for a micro-batch of "
                                 f"{samples} samples; tensors between layers need the samples in dim 0")
            out.append([TensorSpec(tuple(t.shape), t.dtype, t.requires_grad) for t in acts])
        try:
            loss = self.loss(x, labels)
        except Exception as e:
            raise ChainError(f"the loss of {self.name} fails on the last layer's output ({_describe(x)}): "
                             f"{type(e).__name__}: {e}") from None
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            raise ChainError(f"the loss of {self.name} must return a floating-point scalar tensor, got {_describe(loss)}")
        if draws is not None:
            self._draws = draws
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, num_layers={self.num_layers})"


def _probed(layer: nn.Module, x: Any) -> tuple[Any, bool]:
    """``call(layer, x)`` and whether it may draw random numbers. A layer the probe cannot watch (an operation that
    refuses Python dispatch modes, such as some higher-order operators) runs again without it and counts as drawing."""
    try:
        with _DrawProbe() as probe:
            return call(layer, x), probe.draws
    except Exception:
        return call(layer, x), True


class _DrawProbe(TorchDispatchMode):
    """Whether anything run under it may draw from torch's generators (:meth:`LayerChain.draws`)."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.draws:
            self.draws = (torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
                          or getattr(func, "namespace", None) not in ("aten", "prims"))
        return func(*args, **(kwargs or {}))


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor {list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    if isinstance(x, tuple | list):
        return "(" + ", ".join(_describe(v) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in x.items()) + "}"
    return type(x).__name__


def _set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, attr, param)

"""Layered-model contract: an ordered list of layers that can be built piecemeal and deterministically.

Layer 0 consumes the input dict, layers 1..L-2 map a tuple of tensors to a tuple of tensors, and the last
layer maps the tuple plus a label dict to a scalar loss. Layer ``i``'s parameters depend only on
``(seed, i)``, so two processes that build overlapping sets of layers agree on the shared ones.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_SEED_MULT = 1000003
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and grad requirement of one tensor that flows between two layers."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def layer_seed(seed: int, index: int) -> int:
    """Stable per-layer seed: depends only on ``(seed, index)``."""
    return (seed * _SEED_MULT + index) & _MASK63


def layer_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator seeded with :func:`layer_seed`."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(layer_seed(seed, index))
    return gen


def init_module_(module: nn.Module, gen: torch.Generator, std: float) -> None:
    """Initialise ``module`` in place like transformers' ``_init_weights``, drawing from ``gen``.

    Linear / Conv1D weights and embeddings ~ N(0, std), biases 0, LayerNorm (1, 0), embedding padding
    row 0. Modules are visited in ``named_modules`` order, so the result is deterministic.
    """
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.Embedding):
                sub.weight.normal_(0.0, std, generator=gen)
                if sub.padding_idx is not None:
                    sub.weight[sub.padding_idx].zero_()
            elif isinstance(sub, nn.LayerNorm):
                if sub.weight is not None:
                    sub.weight.fill_(1.0)
                if sub.bias is not None:
                    sub.bias.zero_()
            elif isinstance(sub, nn.Linear) or type(sub).__name__ == "Conv1D":
                sub.weight.normal_(0.0, std, generator=gen)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()


class LayeredModel(ABC):
    """A model decomposed into ``num_layers`` ordered layers (embeddings, blocks, head + loss).

    Subclasses implement :meth:`_make_layer`, :meth:`_init_layer` and :meth:`tied_parameters` (and
    override :meth:`activation_spec` if their activations differ). ``config`` is the transformers config
    the layers are built from; ``seq_len`` the default sequence length of the preset.
    """

    family: str = "generic"

    def __init__(self, name: str, config: Any, seq_len: int) -> None:
        self.name = name
        self.config = config
        self.seq_len = seq_len

    # -- structure ---------------------------------------------------------------------------------
    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Number of transformer blocks (layers 1..num_blocks)."""

    @property
    def num_layers(self) -> int:
        """Total layer count: embeddings + blocks + head."""
        return self.num_blocks + 2

    @property
    @abstractmethod
    def hidden_size(self) -> int:
        """Width of the hidden activations."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Vocabulary size of the embedding / output head."""

    @abstractmethod
    def _make_layer(self, index: int) -> nn.Module:
        """Construct (uninitialised) layer ``index``."""

    @abstractmethod
    def _init_layer(self, index: int, layer: nn.Module, seed: int) -> None:
        """Initialise layer ``index`` in place from ``seed`` (and ``index`` only)."""

    @abstractmethod
    def tied_parameters(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        """Pairs ``((layer, param_name), (layer, param_name))`` that must stay equal."""

    def activation_spec(self, boundary: int, micro_batch_size: int, seq_len: int) -> list[TensorSpec]:
        """Tensors flowing INTO layer ``boundary`` (``1 <= boundary <= num_layers - 1``).

        Default (BERT, GPT-2): ``hidden [B,S,H]`` float32 with grad and the ``[B,S]`` int64 1/0 mask.
        """
        if not 1 <= boundary <= self.num_layers - 1:
            raise ValueError(
                f"boundary must be in [1, {self.num_layers - 1}] for {self.name}, got {boundary}"
            )
        return [
            TensorSpec((micro_batch_size, seq_len, self.hidden_size), torch.float32, True),
            TensorSpec((micro_batch_size, seq_len), torch.int64, False),
        ]

    # -- building ----------------------------------------------------------------------------------
    def build_layers(
        self, indices: Sequence[int], seed: int, device: torch.device | str | None = None
    ) -> list[nn.Module]:
        """Build exactly the layers ``indices`` (on CPU, then moved to ``device``), deterministically.

        Layer ``i`` depends only on ``(seed, i)``. Tied parameters are shared (same ``Parameter``)
        when both ends are built in this call, and initialised equal otherwise.
        """
        indices = list(indices)
        for i in indices:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"layer index {i} out of range [0, {self.num_layers}) for {self.name}")
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate layer indices in {indices}")
        layers: dict[int, nn.Module] = {}
        with torch.random.fork_rng(devices=[]):
            for i in indices:
                layer = self._make_layer(i)
                self._init_layer(i, layer, seed)
                layers[i] = layer
        if device is not None:
            for layer in layers.values():
                layer.to(device)
        # tie after moving: .to() may replace Parameter objects (e.g. to/from the meta device)
        for (li, pi), (lj, pj) in self.tied_parameters():
            if li in layers and lj in layers:
                _set_parameter(layers[lj], pj, _get_parameter(layers[li], pi))
        return [layers[i] for i in indices]

    def hf_parameter_name(self, index: int, name: str) -> str:
        """Name of layer ``index``'s parameter ``name`` in the matching transformers model."""
        raise NotImplementedError(f"{type(self).__name__} has no transformers counterpart")

    def hf_state_dict(self, layers: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
        """State dict for the transformers model (e.g. ``BertForPreTraining``) from built layers."""
        out: dict[str, torch.Tensor] = {}
        for index, layer in layers.items():
            for name, param in layer.named_parameters(remove_duplicate=False):
                out[self.hf_parameter_name(index, name)] = param.detach()
        return out

    def layer_num_params(self) -> list[int]:
        """Parameter count of every layer (tied parameters counted in each layer that holds them)."""
        counts = []
        with torch.device("meta"):
            for i in range(self.num_layers):
                counts.append(sum(p.numel() for p in self._make_layer(i).parameters()))
        return counts

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, num_layers={self.num_layers}, seq_len={self.seq_len})"
        )


def _get_parameter(module: nn.Module, name: str) -> nn.Parameter:
    return module.get_parameter(name)


def _set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, attr, param)


def extended_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B,S]`` 1/0 mask -> additive ``[B,1,1,S]`` mask (0 keep, dtype-min drop)."""
    keep = attention_mask[:, None, None, :].to(torch.bool)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=attention_mask.device)
    return torch.where(keep, zero, neg)


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B,S]`` 1/0 mask -> additive causal ``[B,1,S,S]`` mask (0 keep, dtype-min drop)."""
    seq = attention_mask.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    keep = causal[None, None, :, :] & attention_mask[:, None, None, :].to(torch.bool)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=attention_mask.device)
    return torch.where(keep, zero, neg)


def residual_std(std: float, num_blocks: int) -> float:
    """GPT-2's scaled init for residual projections: ``std / sqrt(2 * n_layer)``."""
    return std / math.sqrt(2 * num_blocks)

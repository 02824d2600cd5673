"""Transformer presets as layer chains: ``[embeddings, block x L, head]`` built from a transformers config.

Each layer's factory draws its initialisation from its own generator, seeded with the seed the chain gives
it (``torch.initial_seed()`` inside the factory), so layer ``i`` depends only on ``(seed, i)``. The output
head's weight is tied to the word embedding (declared with the chain's ``tied``), so the head's copy is the
embedding's initialisation wherever the two stages live.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from chimera.models.chain import DataFactory, LayerChain, Loss, Tied


def own_generator() -> torch.Generator:
    """A CPU generator seeded with the seed the chain set for the layer being built."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(torch.initial_seed())
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


class TransformerChain(LayerChain):
    """A transformer preset: a :class:`LayerChain` that also knows its transformers ``config``, sequence length,
    vocabulary and the matching transformers parameter names. Subclasses set ``family`` and the properties."""

    family = "transformer"

    def __init__(self, name: str, config: Any, seq_len: int, factories: Sequence[Callable[[], nn.Module]], loss: Loss,
                 example: tuple[Any, Any], tied: Sequence[Tied], data: DataFactory) -> None:
        self.config = config
        self.seq_len = seq_len
        super().__init__(factories, loss, example, tied=tied, name=name, data=data)

    @property
    def num_blocks(self) -> int:
        """Number of transformer blocks (layers 1..num_blocks)."""
        return self.num_layers - 2

    @property
    def hidden_size(self) -> int:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, num_layers={self.num_layers}, seq_len={self.seq_len})"


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

"""GPT-2 language model decomposed into layers built from transformers' own submodules.

Activations between layers: ``(hidden [B,S,H] float, attention_mask [B,S] int64)``. The 1/0 padding
mask travels with the activations (no grad); every block builds the additive causal + padding mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from chimera.models.base import (
    LayeredModel,
    causal_padding_mask,
    init_module_,
    layer_generator,
    residual_std,
)

EMBED_WEIGHT = "wte.weight"
LM_HEAD_WEIGHT = "lm_head.weight"


class GPT2EmbeddingLayer(nn.Module):
    """Layer 0: token (``wte``) + position (``wpe``) embeddings and embedding dropout."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``inputs``: ``input_ids``, optional ``attention_mask`` and ``position_ids``."""
        ids = inputs["input_ids"]
        position_ids = inputs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        hidden = self.drop(self.wte(ids) + self.wpe(position_ids))
        mask = inputs.get("attention_mask")
        return hidden, torch.ones_like(ids) if mask is None else mask


class GPT2BlockLayer(nn.Module):
    """One ``GPT2Block`` (pre-LN attention + MLP)."""

    def __init__(self, config: GPT2Config, block_index: int) -> None:
        super().__init__()
        self.block = GPT2Block(config, layer_idx=block_index)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Apply the block with a causal + padding mask; the 1/0 mask is passed through."""
        mask4d = causal_padding_mask(attention_mask, hidden.dtype)
        return self.block(hidden, attention_mask=mask4d), attention_mask


class GPT2HeadLayer(nn.Module):
    """Last layer: final LayerNorm, LM head (tied to ``wte``) and the shifted causal-LM loss."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM logits ``[B,S,V]``."""
        return self.lm_head(self.ln_f(hidden))

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, *, labels: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Scalar loss: cross-entropy of position t predicting label t+1 (ignore -100, mean)."""
        logits = self.logits(hidden).float()
        shifted = F.pad(labels["labels"], (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.view(-1, self.vocab_size), shifted.reshape(-1), ignore_index=-100)


class GPT2LM(LayeredModel):
    """GPT-2 LM: ``[GPT2EmbeddingLayer, GPT2BlockLayer × L, GPT2HeadLayer]``."""

    family = "gpt2"

    def __init__(self, name: str, config: GPT2Config, seq_len: int) -> None:
        super().__init__(name, config, seq_len)

    @property
    def num_blocks(self) -> int:
        return int(self.config.n_layer)

    @property
    def hidden_size(self) -> int:
        return int(self.config.n_embd)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def _make_layer(self, index: int) -> nn.Module:
        if index == 0:
            return GPT2EmbeddingLayer(self.config)
        if index == self.num_layers - 1:
            return GPT2HeadLayer(self.config)
        return GPT2BlockLayer(self.config, index - 1)

    def _word_embedding(self, seed: int) -> torch.Tensor:
        """The ``wte`` init, drawn first from layer 0's generator (shared by the tied LM head)."""
        gen = layer_generator(seed, 0)
        return torch.empty(self.vocab_size, self.hidden_size).normal_(
            0.0, self.config.initializer_range, generator=gen
        )

    def _init_layer(self, index: int, layer: nn.Module, seed: int) -> None:
        std = self.config.initializer_range
        gen = layer_generator(seed, index)
        with torch.no_grad():
            if index == 0:
                init_module_(layer.wte, gen, std)  # first draw: equals _word_embedding(seed)
                init_module_(layer.wpe, gen, std)
            elif index == self.num_layers - 1:
                init_module_(layer.ln_f, gen, std)
                layer.lm_head.weight.copy_(self._word_embedding(seed))
            else:
                init_module_(layer, gen, std)
                res_std = residual_std(std, self.num_blocks)
                layer.block.attn.c_proj.weight.normal_(0.0, res_std, generator=gen)
                layer.block.mlp.c_proj.weight.normal_(0.0, res_std, generator=gen)

    def tied_parameters(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        return [((0, EMBED_WEIGHT), (self.num_layers - 1, LM_HEAD_WEIGHT))]

    def hf_parameter_name(self, index: int, name: str) -> str:
        """Map to ``GPT2LMHeadModel`` names (``transformer.wte``, ``transformer.h.i.*``, ``lm_head``)."""
        if index == 0:
            return f"transformer.{name}"
        if index == self.num_layers - 1:
            return name if name.startswith("lm_head") else f"transformer.{name}"
        return f"transformer.h.{index - 1}.{name.removeprefix('block.')}"

"""``GPT2LMHeadModel`` as layers: token + position embeddings, one layer per ``GPT2Block``, ``ln_f`` + LM head.

Activations between layers: ``(hidden [B,S,H], padding mask [B,S])``. The LM head's weight is the token
embedding's (found as one tensor by :func:`chimera.models.decompose.decompose`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chimera.models.hf.common import (
    CausalLMHead,
    Split,
    causal_lm_loss,
    causal_mask,
    lm_labels,
    padding_or_ones,
    refuse_module,
)
from chimera.models.vocab import embedding_shards, head_shards, shard_embedding, shard_linear, vocab_bounds


class GPT2Embedding(nn.Module):
    """Layer 0: ``wte(input_ids) + wpe(position_ids)`` (+ ``wte(token_type_ids)``), dropout, as ``GPT2Model``."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and the padding mask."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.wte(input_ids) + self.wpe(position_ids)
        if token_type_ids is not None:
            hidden = hidden + self.wte(token_type_ids)
        return self.drop(hidden), padding_or_ones(input_ids, attention_mask)


class GPT2Layer(nn.Module):
    """One ``GPT2Block`` with the causal + padding mask ``GPT2Model`` would give it."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, hidden: torch.Tensor, padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the block; the padding mask passes through."""
        return self.block(hidden, None, causal_mask(self.config, hidden, padding)), padding


def split_lm(model: Any, vocab_shards: int = 1) -> Split:
    """``GPT2LMHeadModel`` -> ``[GPT2Embedding, GPT2Layer x n_layer, CausalLMHead]`` with the causal-LM loss;
    ``vocab_shards`` K > 1: K embedding shards and K head shards instead (:mod:`chimera.models.vocab`), holding copies
    of the rows of ``wte`` (and of ``lm_head`` when it is not tied to it), shard j of both one tensor when tied."""
    t, config = model.transformer, model.config
    if getattr(config, "add_cross_attention", False):
        refuse_module(model, "transformer.h.0.crossattention", "cross-attention needs encoder states from outside "
                      "the chain; decompose a GPT-2 without add_cross_attention")
    blocks = [GPT2Layer(block, config) for block in t.h]
    if vocab_shards == 1:
        return Split([GPT2Embedding(t.wte, t.wpe, t.drop), *blocks, CausalLMHead(t.ln_f, model.lm_head)],
                     causal_lm_loss, lm_labels)
    if model.lm_head.bias is not None:
        refuse_module(model, "lm_head", "a head with a bias cannot be split by vocabulary; use vocab_shards=1")
    bounds = vocab_bounds(t.wte.weight.shape[0], vocab_shards)
    wtes = shard_embedding(t.wte.weight, bounds)
    tied = model.lm_head.weight is t.wte.weight
    heads = shard_linear(model.lm_head.weight, bounds, tied=wtes if tied else None)
    slices = {id(w.weight): ("transformer.wte.weight", a, b) for w, (a, b) in zip(wtes, bounds)}
    if not tied:
        slices.update({id(h.weight): ("lm_head.weight", a, b) for h, (a, b) in zip(heads, bounds)})
    layers = [*embedding_shards(wtes, bounds, t.wpe, t.drop), *blocks, *head_shards(t.ln_f, heads)]
    return Split(layers, causal_lm_loss, lm_labels, slices)

"""``LlamaForCausalLM`` as layers: token embedding, one layer per ``LlamaDecoderLayer``, RMSNorm + LM head.

Activations between layers: ``(hidden [B,S,H], padding mask [B,S], position ids [B,S])``. The rotary position
embeddings are computed inside every block layer from the position ids, with its own copy of the model's rotary
module (buffers only, no parameters), as ``LlamaModel`` computes them once for all blocks. The head is untied
unless the config ties it (then :func:`chimera.models.decompose.decompose` finds the shared tensor).
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
)


class TokenEmbedding(nn.Module):
    """Layer 0: ``embed_tokens(input_ids)``; passes the padding mask and the position ids (``[B,S]``) on."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden states, padding mask and position ids (``0..S-1`` when none are given)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        position_ids = position_ids.expand(input_ids.shape[0], -1).contiguous()
        return self.embed_tokens(input_ids), padding_or_ones(input_ids, attention_mask), position_ids


class RotaryDecoderLayer(nn.Module):
    """One decoder layer; computes its rotary ``position_embeddings`` and causal mask as ``LlamaModel`` does."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config

    def forward(self, hidden: torch.Tensor, padding: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Apply the layer; the padding mask and position ids pass through."""
        mask = causal_mask(self.config, hidden, padding, position_ids)
        rope = self.rotary_emb(hidden, position_ids=position_ids)
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
        return out, padding, position_ids


def split_causal_lm(model: Any) -> Split:
    """``LlamaForCausalLM`` -> ``[TokenEmbedding, RotaryDecoderLayer x L, CausalLMHead]`` with the causal-LM loss."""
    m, config = model.model, model.config
    layers: list[nn.Module] = [TokenEmbedding(m.embed_tokens)]
    layers += [RotaryDecoderLayer(layer, m.rotary_emb, config) for layer in m.layers[: config.num_hidden_layers]]
    layers.append(CausalLMHead(m.norm, model.lm_head))
    return Split(layers, causal_lm_loss, lm_labels)

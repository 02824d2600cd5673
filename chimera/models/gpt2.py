"""GPT-2 language model as a layer chain built from transformers' own submodules.

Layers: token + position embeddings, ``GPT2Block`` blocks, final LayerNorm + LM head (tied to the token
embedding, returning logits); the loss is the shifted causal-LM cross-entropy. Activations between layers:
``(hidden [B,S,H] float, attention_mask [B,S] int64)``; every block builds the additive causal + padding mask.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from chimera.data.build import text_dataset
from chimera.data.synthetic import SyntheticGPT2Dataset
from chimera.models.transformer import (
    TransformerChain,
    causal_padding_mask,
    init_module_,
    own_generator,
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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Hidden states and the 1/0 padding mask (all ones when none is given)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        return hidden, torch.ones_like(input_ids) if attention_mask is None else attention_mask


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
    """Last layer: final LayerNorm and the LM head (tied to ``wte``); returns the logits ``[B,S,V]``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """LM logits."""
        return self.lm_head(self.ln_f(hidden))


def lm_loss(logits: torch.Tensor, labels: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of position t predicting label t+1 (ignoring -100, mean)."""
    shifted = F.pad(labels["labels"], (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().flatten(0, -2), shifted.reshape(-1), ignore_index=-100)


def gpt2_layer(config: GPT2Config, index: int) -> nn.Module:
    """Layer ``index`` (embeddings, block or head), initialised like transformers' ``_init_weights``."""
    last = config.n_layer + 1
    std = config.initializer_range
    gen = own_generator()
    with torch.no_grad():
        if index == 0:
            layer: nn.Module = GPT2EmbeddingLayer(config)
            init_module_(layer.wte, gen, std)  # first draw: the tied LM head copies it
            init_module_(layer.wpe, gen, std)
        elif index == last:
            layer = GPT2HeadLayer(config)
            init_module_(layer.ln_f, gen, std)  # lm_head.weight is the tied copy of wte
        else:
            layer = GPT2BlockLayer(config, index - 1)
            init_module_(layer, gen, std)
            res_std = residual_std(std, config.n_layer)
            layer.block.attn.c_proj.weight.normal_(0.0, res_std, generator=gen)
            layer.block.mlp.c_proj.weight.normal_(0.0, res_std, generator=gen)
    return layer


class GPT2LM(TransformerChain):
    """GPT-2 LM chain: ``[GPT2EmbeddingLayer, GPT2BlockLayer x L, GPT2HeadLayer]``, causal-LM loss."""

    family = "gpt2"

    def __init__(self, name: str, config: GPT2Config, seq_len: int, corpus: str | None = None) -> None:
        layers = [partial(gpt2_layer, config, i) for i in range(config.n_layer + 2)]
        example = SyntheticGPT2Dataset(config.vocab_size, seq_len, 1, 0).get(0, 0, 0)
        tied = [((0, EMBED_WEIGHT), (len(layers) - 1, LM_HEAD_WEIGHT))]
        data = partial(text_dataset, "gpt2", config.vocab_size, seq_len, corpus)
        super().__init__(name, config, seq_len, layers, lm_loss, example, tied, data)

    @property
    def hidden_size(self) -> int:
        return int(self.config.n_embd)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def hf_parameter_name(self, index: int, name: str) -> str:
        """Map to ``GPT2LMHeadModel`` names (``transformer.wte``, ``transformer.h.i.*``, ``lm_head``)."""
        if index == 0:
            return f"transformer.{name}"
        if index == self.num_layers - 1:
            return name if name.startswith("lm_head") else f"transformer.{name}"
        return f"transformer.h.{index - 1}.{name.removeprefix('block.')}"

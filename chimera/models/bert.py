"""BERT for pretraining (MLM + NSP) decomposed into layers built from transformers' own submodules.

Activations between layers: ``(hidden [B,S,H] float, attention_mask [B,S] int64)``. The 1/0 mask
travels with the activations (no grad); every block turns it into the additive mask it needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer, BertPooler, BertPreTrainingHeads

from chimera.models.base import LayeredModel, extended_padding_mask, init_module_, layer_generator

EMBED_WEIGHT = "embeddings.word_embeddings.weight"
DECODER_WEIGHT = "heads.predictions.decoder.weight"


def _mask_or_ones(inputs: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    mask = inputs.get("attention_mask")
    return torch.ones_like(ids) if mask is None else mask


class BertEmbeddingLayer(nn.Module):
    """Layer 0: word + position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)

    def forward(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``inputs``: ``input_ids``, optional ``token_type_ids``, ``attention_mask``, ``position_ids``."""
        ids = inputs["input_ids"]
        hidden = self.embeddings(
            input_ids=ids,
            token_type_ids=inputs.get("token_type_ids"),
            position_ids=inputs.get("position_ids"),
        )
        return hidden, _mask_or_ones(inputs, ids)


class BertBlockLayer(nn.Module):
    """One ``BertLayer`` (self-attention + feed-forward)."""

    def __init__(self, config: BertConfig, block_index: int) -> None:
        super().__init__()
        self.layer = BertLayer(config, layer_idx=block_index)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Apply the block; the padding mask is passed through unchanged."""
        ext = extended_padding_mask(attention_mask, hidden.dtype)
        return self.layer(hidden, attention_mask=ext), attention_mask


class BertHeadLayer(nn.Module):
    """Last layer: pooler, MLM + NSP heads, and the pretraining loss (MLM CE + NSP CE)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.pooler = BertPooler(config)
        self.heads = BertPreTrainingHeads(config)
        # as in BertForPreTraining: the decoder bias is the prediction head's bias
        self.heads.predictions.decoder.bias = self.heads.predictions.bias

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLM logits ``[B,S,V]`` and NSP logits ``[B,2]``."""
        return self.heads(hidden, self.pooler(hidden))

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, *, labels: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Scalar loss: MLM cross-entropy (ignore -100, mean) + NSP cross-entropy (mean)."""
        mlm_logits, nsp_logits = self.logits(hidden)
        mlm = F.cross_entropy(
            mlm_logits.float().view(-1, self.vocab_size), labels["labels"].reshape(-1), ignore_index=-100
        )
        nsp = F.cross_entropy(nsp_logits.float().view(-1, 2), labels["next_sentence_label"].reshape(-1))
        return mlm + nsp


class BertPretraining(LayeredModel):
    """BERT pretraining model: ``[BertEmbeddingLayer, BertBlockLayer × L, BertHeadLayer]``."""

    family = "bert"

    def __init__(self, name: str, config: BertConfig, seq_len: int) -> None:
        super().__init__(name, config, seq_len)

    @property
    def num_blocks(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def _make_layer(self, index: int) -> nn.Module:
        if index == 0:
            return BertEmbeddingLayer(self.config)
        if index == self.num_layers - 1:
            return BertHeadLayer(self.config)
        return BertBlockLayer(self.config, index - 1)

    def _word_embedding(self, seed: int) -> torch.Tensor:
        """The word-embedding init, drawn first from layer 0's generator (shared by the tied decoder)."""
        gen = layer_generator(seed, 0)
        weight = torch.empty(self.vocab_size, self.hidden_size).normal_(
            0.0, self.config.initializer_range, generator=gen
        )
        if self.config.pad_token_id is not None:
            weight[self.config.pad_token_id].zero_()
        return weight

    def _init_layer(self, index: int, layer: nn.Module, seed: int) -> None:
        std = self.config.initializer_range
        with torch.no_grad():
            if index == 0:
                gen = layer_generator(seed, 0)
                # consume the word-embedding draw first, then the rest of layer 0
                init_module_(layer.embeddings.word_embeddings, gen, std)
                init_module_(layer.embeddings.position_embeddings, gen, std)
                init_module_(layer.embeddings.token_type_embeddings, gen, std)
                init_module_(layer.embeddings.LayerNorm, gen, std)
                return
            init_module_(layer, layer_generator(seed, index), std)
            if index == self.num_layers - 1:
                layer.heads.predictions.bias.zero_()
                layer.heads.predictions.decoder.weight.copy_(self._word_embedding(seed))

    def tied_parameters(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        return [((0, EMBED_WEIGHT), (self.num_layers - 1, DECODER_WEIGHT))]

    def hf_parameter_name(self, index: int, name: str) -> str:
        """Map to ``BertForPreTraining`` names (``bert.embeddings.*``, ``bert.encoder.layer.i.*``, ``cls.*``)."""
        if index == 0:
            return f"bert.{name}"
        if index == self.num_layers - 1:
            head, _, rest = name.partition(".")
            return f"bert.pooler.{rest}" if head == "pooler" else f"cls.{rest}"
        return f"bert.encoder.layer.{index - 1}.{name.removeprefix('layer.')}"

"""BERT for pretraining (MLM + NSP) as a layer chain built from transformers' own submodules.

Layers: embeddings, ``BertLayer`` blocks, pooler + pretraining heads (returning the MLM and NSP logits); the
loss is MLM cross-entropy + NSP cross-entropy. Activations between layers: ``(hidden [B,S,H] float,
attention_mask [B,S] int64)``: the 1/0 mask travels with the activations (no grad) and every block turns it
into the additive mask it needs.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer, BertPooler, BertPreTrainingHeads

from chimera.data.build import text_dataset
from chimera.data.synthetic import SyntheticBertDataset
from chimera.models.transformer import TransformerChain, extended_padding_mask, init_module_, own_generator

EMBED_WEIGHT = "embeddings.word_embeddings.weight"
DECODER_WEIGHT = "heads.predictions.decoder.weight"


class BertEmbeddingLayer(nn.Module):
    """Layer 0: word + position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, ...]:
        """Hidden states and the 1/0 padding mask (all ones when none is given)."""
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
        return hidden, torch.ones_like(input_ids) if attention_mask is None else attention_mask


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
    """Last layer: pooler and the MLM + NSP heads; returns ``(mlm_logits [B,S,V], nsp_logits [B,2])``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.pooler = BertPooler(config)
        self.heads = BertPreTrainingHeads(config)
        # as in BertForPreTraining: the decoder bias is the prediction head's bias
        self.heads.predictions.decoder.bias = self.heads.predictions.bias

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLM and NSP logits."""
        return self.heads(hidden, self.pooler(hidden))


def pretraining_loss(logits: tuple[torch.Tensor, torch.Tensor], labels: dict[str, torch.Tensor]) -> torch.Tensor:
    """MLM cross-entropy (ignoring -100, mean) + NSP cross-entropy (mean)."""
    mlm_logits, nsp_logits = logits
    mlm = F.cross_entropy(mlm_logits.float().flatten(0, -2), labels["labels"].reshape(-1), ignore_index=-100)
    nsp = F.cross_entropy(nsp_logits.float().view(-1, 2), labels["next_sentence_label"].reshape(-1))
    return mlm + nsp


def bert_layer(config: BertConfig, index: int) -> nn.Module:
    """Layer ``index`` (embeddings, block or head), initialised like transformers' ``_init_weights``."""
    last = config.num_hidden_layers + 1
    std = config.initializer_range
    gen = own_generator()
    with torch.no_grad():
        if index == 0:
            layer: nn.Module = BertEmbeddingLayer(config)
            # the word embedding is drawn first (the tied decoder copies it), then the rest of layer 0
            for part in ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm"):
                init_module_(getattr(layer.embeddings, part), gen, std)
        elif index == last:
            layer = BertHeadLayer(config)
            init_module_(layer, gen, std)
            layer.heads.predictions.bias.zero_()
        else:
            layer = BertBlockLayer(config, index - 1)
            init_module_(layer, gen, std)
    return layer


class BertPretraining(TransformerChain):
    """BERT pretraining chain: ``[BertEmbeddingLayer, BertBlockLayer x L, BertHeadLayer]``, MLM + NSP loss."""

    family = "bert"

    def __init__(self, name: str, config: BertConfig, seq_len: int, corpus: str | None = None) -> None:
        layers = [partial(bert_layer, config, i) for i in range(config.num_hidden_layers + 2)]
        example = SyntheticBertDataset(config.vocab_size, seq_len, 1, 0).get(0, 0, 0)
        tied = [((0, EMBED_WEIGHT), (len(layers) - 1, DECODER_WEIGHT))]
        data = partial(text_dataset, "bert", config.vocab_size, seq_len, corpus)
        super().__init__(name, config, seq_len, layers, pretraining_loss, example, tied, data)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def hf_parameter_name(self, index: int, name: str) -> str:
        """Map to ``BertForPreTraining`` names (``bert.embeddings.*``, ``bert.encoder.layer.i.*``, ``cls.*``)."""
        if index == 0:
            return f"bert.{name}"
        if index == self.num_layers - 1:
            head, _, rest = name.partition(".")
            return f"bert.pooler.{rest}" if head == "pooler" else f"cls.{rest}"
        return f"bert.encoder.layer.{index - 1}.{name.removeprefix('layer.')}"


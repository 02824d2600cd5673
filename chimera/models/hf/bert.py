"""BERT as layers: ``BertEmbeddings``, one layer per ``BertLayer``, and the head of the task.

``BertForPreTraining``: pooler + MLM/NSP heads (the decoder weight is the word embedding's, its bias the
prediction head's bias), loss MLM + NSP cross-entropy. ``BertForSequenceClassification``: pooler, dropout and
classifier, loss as the config's ``problem_type`` says (MSE, cross-entropy or BCE), exactly as transformers
computes it with ``labels=``. Activations between layers: ``(hidden [B,S,H], padding mask [B,S])``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chimera.models.hf.common import Split, bidirectional_mask, causal_mask, padding_or_ones, refuse_module


class BertEmbedding(nn.Module):
    """Layer 0: ``BertEmbeddings`` (word + position + token type, LayerNorm, dropout)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and the padding mask."""
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
        return hidden, padding_or_ones(input_ids, attention_mask)


class BertBlock(nn.Module):
    """One ``BertLayer`` with the mask ``BertModel`` gives it (bidirectional; causal for a decoder config)."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, hidden: torch.Tensor, padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the block; the padding mask passes through."""
        if self.config.is_decoder:
            mask = causal_mask(self.config, hidden, padding)
        else:
            mask = bidirectional_mask(self.config, hidden, padding)
        return self.layer(hidden, mask), padding


class PretrainingHead(nn.Module):
    """Last layer of ``BertForPreTraining``: pooler and ``cls``; returns ``(mlm_logits [B,S,V], nsp_logits [B,2])``."""

    def __init__(self, pooler: nn.Module, cls: nn.Module) -> None:
        super().__init__()
        self.pooler = pooler
        self.cls = cls

    def forward(self, hidden: torch.Tensor, padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLM and NSP logits."""
        return self.cls(hidden, self.pooler(hidden))


class SequenceClassificationHead(nn.Module):
    """Last layer of ``BertForSequenceClassification``: pooler, dropout, classifier; returns ``[B, num_labels]``."""

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler = pooler
        self.dropout = dropout
        self.classifier = classifier

    def forward(self, hidden: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """Classification logits (or regression values)."""
        return self.classifier(self.dropout(self.pooler(hidden)))


def pretraining_loss(logits: tuple[torch.Tensor, torch.Tensor], labels: dict[str, torch.Tensor]) -> torch.Tensor:
    """``BertForPreTraining``'s loss: MLM cross-entropy (-100 ignored) + NSP cross-entropy, both means."""
    mlm, nsp = logits
    ce = nn.CrossEntropyLoss()
    return ce(mlm.view(-1, mlm.shape[-1]), labels["labels"].view(-1)) + ce(
        nsp.view(-1, 2), labels["next_sentence_label"].view(-1))


class SequenceClassificationLoss:
    """``BertForSequenceClassification``'s loss for ``num_labels`` and the config's ``problem_type``.

    ``problem_type`` None decides per call as transformers does: one label -> regression (MSE), integer labels ->
    single-label (cross-entropy), otherwise multi-label (BCE with logits).
    """

    def __init__(self, num_labels: int, problem_type: str | None) -> None:
        self.num_labels = num_labels
        self.problem_type = problem_type

    def kind(self, labels: torch.Tensor) -> str:
        """The problem type used for ``labels``."""
        if self.problem_type is not None:
            return self.problem_type
        if self.num_labels == 1:
            return "regression"
        if labels.dtype in (torch.long, torch.int):
            return "single_label_classification"
        return "multi_label_classification"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        kind = self.kind(labels)
        if kind == "regression":
            if self.num_labels == 1:
                return nn.functional.mse_loss(logits.squeeze(), labels.squeeze())
            return nn.functional.mse_loss(logits, labels)
        if kind == "single_label_classification":
            return nn.functional.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        if kind == "multi_label_classification":
            return nn.functional.binary_cross_entropy_with_logits(logits, labels)
        raise ValueError(f"problem_type {kind!r} is not one of regression, single_label_classification, "
                         "multi_label_classification (set config.problem_type)")


def _blocks(model: Any, prefix: str) -> list[nn.Module]:
    bert, config = model.bert, model.config
    if getattr(config, "add_cross_attention", False):
        refuse_module(model, f"{prefix}.encoder.layer.0.crossattention", "cross-attention needs encoder states from "
                      "outside the chain; decompose a BERT without add_cross_attention")
    if bert.pooler is None:
        refuse_module(model, f"{prefix}.pooler", "the heads need the pooler; build the model with its pooling layer")
    return [BertEmbedding(bert.embeddings)] + [BertBlock(layer, config) for layer in bert.encoder.layer]


def split_pretraining(model: Any) -> Split:
    """``BertForPreTraining`` -> ``[BertEmbedding, BertBlock x L, PretrainingHead]``, MLM + NSP loss."""
    layers = _blocks(model, "bert") + [PretrainingHead(model.bert.pooler, model.cls)]

    def labels_for(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"labels": ids.clone(), "next_sentence_label": torch.zeros(ids.shape[0], dtype=torch.long)}

    return Split(layers, pretraining_loss, labels_for)


def split_sequence_classification(model: Any) -> Split:
    """``BertForSequenceClassification`` -> ``[BertEmbedding, BertBlock x L, SequenceClassificationHead]``."""
    config = model.config
    layers = _blocks(model, "bert") + [SequenceClassificationHead(model.bert.pooler, model.dropout, model.classifier)]
    loss = SequenceClassificationLoss(int(config.num_labels), config.problem_type)

    def labels_for(ids: torch.Tensor) -> torch.Tensor:
        kind = loss.problem_type or ("regression" if loss.num_labels == 1 else "single_label_classification")
        if kind == "single_label_classification":
            return torch.zeros(ids.shape[0], dtype=torch.long)
        return torch.zeros(ids.shape[0], loss.num_labels)

    return Split(layers, loss, labels_for)

"""Tiny transformers models for the decompose / export tests (hidden 32, 2 blocks, 64 tokens, dropout off)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 64
SEQ = 16


def tiny(arch: str, **overrides: Any) -> nn.Module:
    """A randomly initialised ``arch`` (seeded), dropout off, attention as transformers picks it (SDPA)."""
    import transformers

    torch.manual_seed(0)
    if arch.startswith("Bert"):
        cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides)
    elif arch.startswith("GPT2"):
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, **overrides)
    else:
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=32, bos_token_id=0, eos_token_id=0, **overrides)
    return getattr(transformers, arch)(cfg)


def tokens(step: int, mb: int, rank: int, batch: int = 2, padded: bool = True) -> dict[str, torch.Tensor]:
    """Token ids and a padding mask (the first sample's last 4 positions padded when ``padded``)."""
    g = torch.Generator().manual_seed(step * 100 + mb * 10 + rank)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def labels_for(arch: str, inputs: dict[str, torch.Tensor], num_labels: int = 3) -> Any:
    """Labels of the kind ``arch``'s loss takes (``model(**inputs, **labels)`` in transformers' names)."""
    ids = inputs["input_ids"]
    g = torch.Generator().manual_seed(int(ids.sum()))
    if arch == "BertForPreTraining":
        mlm = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        return {"labels": mlm, "next_sentence_label": torch.randint(0, 2, (ids.shape[0],), generator=g)}
    if arch == "BertForSequenceClassification":
        return {"labels": torch.randint(0, num_labels, (ids.shape[0],), generator=g)}
    return {"labels": torch.where(inputs["attention_mask"].bool(), ids, torch.full_like(ids, -100))}


def chain_labels(arch: str, labels: dict[str, torch.Tensor]) -> Any:
    """The same labels as the decomposed chain's loss takes them (sequence classification: the tensor)."""
    return labels["labels"] if arch == "BertForSequenceClassification" else labels


def batch(arch: str):
    """``(step, micro_batch, rank) -> (inputs, labels)`` for the chain of ``arch``."""
    def get(step: int, mb: int, rank: int) -> tuple[Any, Any]:
        inputs = tokens(step, mb, rank)
        return inputs, chain_labels(arch, labels_for(arch, inputs))
    return get

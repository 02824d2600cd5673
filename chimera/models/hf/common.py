"""Pieces shared by the transformers families: attention masks built inside each block, causal-LM heads, losses.

Every block wrapper builds its own attention mask from the 1/0 padding mask that travels between layers, with
transformers' own ``create_causal_mask`` / ``create_bidirectional_mask`` and the model's config, so each block
sees exactly the mask (or ``None``, for SDPA without padding) that the transformers model gives it. On the meta
device (shape inference) no mask is built: it never changes a shape.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

from chimera.models.chain import ChainError


def causal_mask(config: Any, hidden: torch.Tensor, padding: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> Any:
    """The mask a causal transformers model passes to its blocks (None on the meta device)."""
    if hidden.is_meta:
        return None
    return create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=padding, past_key_values=None,
                              position_ids=position_ids)


def bidirectional_mask(config: Any, hidden: torch.Tensor, padding: torch.Tensor) -> Any:
    """The mask an encoder (BERT) passes to its blocks (None on the meta device)."""
    if hidden.is_meta:
        return None
    return create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=padding)


def padding_or_ones(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The 1/0 padding mask that travels with the activations (all ones when none is given)."""
    return torch.ones_like(input_ids) if attention_mask is None else attention_mask


class CausalLMHead(nn.Module):
    """Last layer of a decoder: the final norm and the LM head; returns the logits ``[B, S, V]``.

    ``CausalLMHead(model.transformer.ln_f, model.lm_head)(hidden, padding)``; later activations are ignored.
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        """LM logits of every position."""
        return self.lm_head(self.norm(hidden))


def causal_lm_loss(logits: torch.Tensor, labels: Any) -> torch.Tensor:
    """transformers' causal-LM loss (``model(..., labels=)``): mean cross-entropy of position t predicting token t+1.

    ``labels``: the token ids as given to the model (a tensor or ``{"labels": ids}``: shifted here, -100 ignored),
    or ``{"shift_labels": ids}`` already shifted (every position predicts its label, as transformers'
    ``shift_labels=``).
    """
    if isinstance(labels, dict):
        if "shift_labels" in labels:
            shifted = labels["shift_labels"].contiguous()
            return ForCausalLMLoss(logits, None, vocab_size=logits.shape[-1], shift_labels=shifted)
        if "labels" not in labels:
            raise ValueError(f"causal-LM labels need a 'labels' or 'shift_labels' entry, got {sorted(labels)}")
        labels = labels["labels"]
    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


class Split:
    """A transformers model cut into layers: the layer modules, the model's loss and example labels for token ids.

    ``labels_for(input_ids)`` returns labels shaped as the loss takes them (for the chain's example micro-batch);
    ``slices`` names the tensors that are copies of some rows of one of the model's (a matrix split by vocabulary).
    """

    def __init__(self, layers: list[nn.Module], loss: Any, labels_for: Any,
                 slices: dict[int, tuple[str, int, int]] | None = None) -> None:
        self.layers = layers
        self.loss = loss
        self.labels_for = labels_for
        self.slices = slices or {}  # id of a layer's tensor -> (the model's name, first row, row after): a copy of rows


def refuse_module(model: nn.Module, path: str, why: str) -> NoReturn:
    """Raise the :class:`~chimera.models.chain.ChainError` for a part of ``model`` that cannot be split."""
    raise ChainError(f"decompose: {type(model).__name__} cannot be split at module {path!r}: {why}")


def lm_labels(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Causal-LM labels of an example: the token ids themselves (the loss shifts them)."""
    return {"labels": input_ids.clone()}

"""A token embedding and its LM head split by vocabulary rows into K layers each (``vocab_shards``), so that no
layer holds the whole ``[V, H]`` matrix: with weights streamed in packs of one layer (``--offload-pack 1``) a
worker then needs only ``V / K`` rows (and their gradient) on the device at once.

    bounds = vocab_bounds(50257, 8)                        # [(0, 6282), (6282, 12564), ...]
    layers = embedding_shards(wte, wpe, drop, bounds) + blocks + head_shards(ln_f, heads, bounds)

Shard ``j`` of the embedding holds rows ``[j·V/K, (j+1)·V/K)``; the embedding shards run in order, each adding
the embeddings of the tokens in its rows to a partial sum that travels with the token ids (exact zeros for the
others, so the sum is the full lookup, bit for bit), and the last adds the position embeddings. Head shard ``j``
holds the same rows of the LM head and appends its slice of the logits; the last concatenates them, so the loss
sees the full logits. Embedding shard ``j`` and head shard ``j`` hold one parameter when the model ties them
(same shape: the chain's ``tied`` pairs sum their gradients as for the unsharded pair).

Activations: embedding shards pass ``(partial [B,S,H], input_ids, mask, positions [B,S])``, the last one
``(hidden, mask)`` as the unsharded embedding; head shards pass ``(normed hidden, logits slices...)``.
"""

from __future__ import annotations

import torch
from torch import nn


def vocab_bounds(vocab: int, shards: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` of every shard: ``j * vocab // shards`` to ``(j + 1) * vocab // shards``."""
    if not 1 <= shards <= vocab:
        raise ValueError(f"vocab_shards must be in [1, {vocab}] (the vocabulary's size), got {shards}")
    return [(j * vocab // shards, (j + 1) * vocab // shards) for j in range(shards)]


def _lookup(wte: nn.Embedding, start: int, input_ids: torch.Tensor) -> torch.Tensor:
    """Embeddings of the tokens in rows ``[start, start + rows)``, exact zeros for every other token."""
    local = input_ids - start
    inside = (local >= 0) & (local < wte.num_embeddings)
    emb = wte(torch.where(inside, local, torch.zeros_like(local)))
    return torch.where(inside.unsqueeze(-1), emb, torch.zeros((), dtype=emb.dtype, device=emb.device))


class TokenShard(nn.Module):
    """An embedding shard between the first and the last: adds its rows' embeddings to the partial sum."""

    def __init__(self, wte: nn.Embedding, start: int) -> None:
        super().__init__()
        self.wte = wte
        self.start = start

    def forward(self, partial: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The partial sum with this shard's rows added; the rest passes through."""
        return partial + _lookup(self.wte, self.start, input_ids), input_ids, mask, positions


class FirstTokenShard(TokenShard):
    """Embedding shard 0: takes the micro-batch's inputs, starts the partial sum."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,  # type: ignore[override]
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, ...]:
        """``(its rows' embeddings, input_ids, 1/0 mask, position ids [B,S])`` (ones and ``0..S-1`` when not
        given)."""
        if token_type_ids is not None:
            raise ValueError("token_type_ids go through the whole token embedding: a model split by vocabulary "
                             "(vocab_shards > 1) does not take them; drop them from the inputs or use vocab_shards=1")
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return _lookup(self.wte, self.start, input_ids), input_ids, mask, position_ids.expand(b, s)


class LastTokenShard(TokenShard):
    """The last embedding shard: completes the token embeddings, adds the position embeddings and dropout."""

    def __init__(self, wte: nn.Embedding, start: int, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__(wte, start)
        self.wpe = wpe
        self.drop = drop

    def forward(self, partial: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(hidden, mask)``, as the unsharded embedding layer returns them."""
        tokens = partial + _lookup(self.wte, self.start, input_ids)
        return self.drop(tokens + self.wpe(positions)), mask


class HeadShard(nn.Module):
    """A head shard after the first: appends its slice of the logits (the last one: returns them all, joined)."""

    def __init__(self, lm_head: nn.Linear, last: bool) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.last = last

    def forward(self, normed: torch.Tensor, *slices: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``(normed, *slices, its slice)``, or the logits ``[B,S,V]`` for the last shard."""
        out = (*slices, self.lm_head(normed))
        return torch.cat(out, dim=-1) if self.last else (normed, *out)


class FirstHeadShard(nn.Module):
    """Head shard 0: the final norm, then its slice of the logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed hidden, its slice of the logits)``; later activations (the mask) are dropped."""
        normed = self.ln_f(hidden)
        return normed, self.lm_head(normed)


def embedding_shards(wtes: list[nn.Embedding], bounds: list[tuple[int, int]], wpe: nn.Embedding,
                     drop: nn.Module) -> list[nn.Module]:
    """The embedding layers, one per shard (``wtes[j]`` holds rows ``bounds[j]``); at least two shards."""
    if len(wtes) < 2 or len(wtes) != len(bounds):
        raise ValueError(f"embedding shards need at least two shards and one embedding per bound, got {len(wtes)} "
                         f"embeddings for {len(bounds)} bounds")
    first, *middle, last = zip(wtes, bounds)
    return [FirstTokenShard(first[0], first[1][0]), *(TokenShard(w, b[0]) for w, b in middle),
            LastTokenShard(last[0], last[1][0], wpe, drop)]


def head_shards(norm: nn.Module, heads: list[nn.Linear]) -> list[nn.Module]:
    """The head layers, one per shard (``heads[j]`` produces logits of shard ``j``'s rows); at least two shards."""
    if len(heads) < 2:
        raise ValueError(f"head shards need at least two shards, got {len(heads)}")
    return [FirstHeadShard(norm, heads[0]), *(HeadShard(h, last=False) for h in heads[1:-1]),
            HeadShard(heads[-1], last=True)]


def shard_embedding(weight: torch.Tensor, bounds: list[tuple[int, int]]) -> list[nn.Embedding]:
    """Embeddings holding copies of ``weight``'s rows ``bounds[j]`` (a loaded model's matrix, split)."""
    return [nn.Embedding.from_pretrained(weight.detach()[a:b].clone(), freeze=False) for a, b in bounds]


def shard_linear(weight: nn.Parameter, bounds: list[tuple[int, int]],
                 tied: list[nn.Embedding] | None = None) -> list[nn.Linear]:
    """Bias-free linear layers producing ``bounds[j]``'s outputs: ``tied[j]``'s parameter (one tensor with the
    embedding shard) or copies of ``weight``'s rows."""
    out = []
    for j, (a, b) in enumerate(bounds):
        lin = nn.Linear(weight.shape[1], b - a, bias=False, device="meta")
        lin.weight = tied[j].weight if tied is not None else nn.Parameter(weight.detach()[a:b].clone())
        out.append(lin)
    return out


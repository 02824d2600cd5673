"""GPT-2 language model as a layer chain built from transformers' own submodules.

Layers: token + position embeddings, ``GPT2Block`` blocks, final LayerNorm + LM head (tied to the token
embedding, returning logits); the loss is the shifted causal-LM cross-entropy. Activations between layers:
``(hidden [B,S,H] float, attention_mask [B,S] int64)``; every block builds the additive causal + padding mask.

``vocab_shards=K`` (K > 1) splits the token embedding and the head by vocabulary rows into K layers each
(:mod:`chimera.models.vocab`), embedding shard j tied to head shard j: the same model, computed in smaller
layers, so that weights streamed in packs of one layer fit a small device. Every part is seeded as the whole
layer it comes from (``seed_index``): an embedding shard draws the whole matrix and keeps its rows, so the initial
weights and the dropout masks are those of ``vocab_shards=1``, and the two train alike (within float rounding).
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
from chimera.models.vocab import (
    FirstHeadShard,
    FirstTokenShard,
    HeadShard,
    LastTokenShard,
    TokenShard,
    vocab_bounds,
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


def gpt2_sharded_layer(config: GPT2Config, shards: int, index: int) -> nn.Module:
    """Layer ``index`` of the chain split by vocabulary into ``shards`` (module docstring): embedding shards
    ``0..K-1`` (each its ``wte`` rows, then ``wpe`` in the last, ~ N(0, std)), the blocks, head shards (``ln_f`` in
    the first; the LM head shards are tied copies of the embedding shards)."""
    bounds = vocab_bounds(config.vocab_size, shards)
    blocks, hidden = config.n_layer, config.hidden_size
    if shards <= index < shards + blocks:
        return gpt2_layer(config, index - shards + 1)
    gen = own_generator()
    with torch.no_grad():
        if index < shards:
            start, stop = bounds[index]
            whole = torch.empty(config.vocab_size, hidden)  # the unsplit embedding's draw (module docstring)
            whole.normal_(0.0, config.initializer_range, generator=gen)
            wte = nn.Embedding(stop - start, hidden, _weight=whole[start:stop].clone())
            if index == 0:
                return FirstTokenShard(wte, start)
            if index < shards - 1:
                return TokenShard(wte, start)
            wpe = nn.Embedding(config.max_position_embeddings, hidden)
            init_module_(wpe, gen, config.initializer_range)
            return LastTokenShard(wte, start, wpe, nn.Dropout(config.embd_pdrop))
        j = index - shards - blocks
        start, stop = bounds[j]
        head = nn.Linear(hidden, stop - start, bias=False)  # the tied copy of embedding shard j
        if j > 0:
            return HeadShard(head, last=j == shards - 1)
        return FirstHeadShard(nn.LayerNorm(hidden, eps=config.layer_norm_epsilon), head)  # LayerNorm: (1, 0)


class GPT2LM(TransformerChain):
    """GPT-2 LM chain: ``[GPT2EmbeddingLayer, GPT2BlockLayer x L, GPT2HeadLayer]``, causal-LM loss; with
    ``vocab_shards`` K > 1, K embedding shards and K head shards instead (module docstring)."""

    family = "gpt2"

    def __init__(self, name: str, config: GPT2Config, seq_len: int, corpus: str | None = None,
                 vocab_shards: int = 1) -> None:
        self.vocab_shards = vocab_shards
        self.bounds = vocab_bounds(config.vocab_size, vocab_shards)
        if vocab_shards == 1:
            layers = [partial(gpt2_layer, config, i) for i in range(config.n_layer + 2)]
            tied = [((0, EMBED_WEIGHT), (len(layers) - 1, LM_HEAD_WEIGHT))]
        else:
            layers = [partial(gpt2_sharded_layer, config, vocab_shards, i)
                      for i in range(config.n_layer + 2 * vocab_shards)]
            head0 = vocab_shards + config.n_layer
            tied = [((j, EMBED_WEIGHT), (head0 + j, LM_HEAD_WEIGHT)) for j in range(vocab_shards)]
        example = SyntheticGPT2Dataset(config.vocab_size, seq_len, 1, 0).get(0, 0, 0)
        data = partial(text_dataset, "gpt2", config.vocab_size, seq_len, corpus)
        super().__init__(name, config, seq_len, layers, lm_loss, example, tied, data)

    def seed_index(self, index: int) -> int:
        """The unsplit chain's index of the layer that ``index`` is (a part of): embedding shards 0, head shards
        the head's (module docstring)."""
        k, blocks = self.vocab_shards, self.num_blocks
        return index if k == 1 else 0 if index < k else index - k + 1 if index < k + blocks else blocks + 1

    @property
    def num_blocks(self) -> int:
        return int(self.config.n_layer)

    @property
    def hidden_size(self) -> int:
        return int(self.config.n_embd)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def hf_parameter_name(self, index: int, name: str) -> str:
        """Map to ``GPT2LMHeadModel`` names (``transformer.wte``, ``transformer.h.i.*``, ``lm_head``); a shard's
        ``wte.weight`` / ``lm_head.weight`` names the whole matrix it holds rows of."""
        k = self.vocab_shards
        if index < k:
            return f"transformer.{name}"
        if index >= k + self.num_blocks:
            return name if name.startswith("lm_head") else f"transformer.{name}"
        return f"transformer.h.{index - k}.{name.removeprefix('block.')}"

    def hf_state_dict(self, layers: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
        """As :meth:`TransformerChain.hf_state_dict`; vocabulary shards joined into the whole matrices (every shard
        of a matrix must be among ``layers``)."""
        k, head0 = self.vocab_shards, self.vocab_shards + self.num_blocks
        sharded = {"wte.weight": range(k), "lm_head.weight": range(head0, head0 + k)} if k > 1 else {}
        out: dict[str, torch.Tensor] = {}
        for index, layer in layers.items():
            for name, param in layer.named_parameters(remove_duplicate=False):
                if index not in sharded.get(name, ()):
                    out[self.hf_parameter_name(index, name)] = param.detach()
        for name, indices in sharded.items():
            shards = [layers.get(i) for i in indices]
            if all(m is None for m in shards):
                continue
            if any(m is None for m in shards):
                raise ValueError(f"{name} is split over layers {indices.start}..{indices.stop - 1}: give all of them")
            out[self.hf_parameter_name(indices.start, name)] = torch.cat(
                [m.get_parameter(name).detach() for m in shards])  # type: ignore[union-attr]
        return out

"""Named model presets and :func:`build_model`.

Dropout is 0 and attention is eager in every preset so that runs are deterministic. ``bert-tiny`` and
``gpt2-tiny`` use an 8192-token vocabulary (instead of 30522 / 50257) so that tests run fast on CPU;
the other presets use the real vocabularies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chimera.models.chain import LayerChain
from chimera.models.delay import DelayConfig, DelayModel

_BERT_DETERMINISTIC = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
_GPT2_DETERMINISTIC = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _bert(
    layers: int, hidden: int, heads: int, inter: int, vocab: int = 30522, positions: int = 512
) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        return {
            "family": "bert",
            "seq_len": 128,
            "config": dict(
                num_hidden_layers=layers,
                hidden_size=hidden,
                num_attention_heads=heads,
                intermediate_size=inter,
                vocab_size=vocab,
                max_position_embeddings=positions,
                **_BERT_DETERMINISTIC,
            ),
        }

    return make


def _gpt2(
    layers: int, hidden: int, heads: int, vocab: int = 50257, positions: int = 1024, seq_len: int = 1024
) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        return {
            "family": "gpt2",
            "seq_len": seq_len,
            "config": dict(
                n_layer=layers,
                n_embd=hidden,
                n_head=heads,
                vocab_size=vocab,
                n_positions=positions,
                bos_token_id=vocab - 1,
                eos_token_id=vocab - 1,
                **_GPT2_DETERMINISTIC,
            ),
        }

    return make


#: name -> builder of ``{"family", "seq_len" (default), "config" (kwargs of the config class)}``
PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "bert-tiny": _bert(2, 128, 2, 512, vocab=8192),
    "bert-mini": _bert(4, 256, 4, 1024),
    "bert-base": _bert(12, 768, 12, 3072),
    "bert-large": _bert(24, 1024, 16, 4096),
    "bert-48": _bert(48, 1024, 16, 4096),
    "gpt2-tiny": _gpt2(4, 128, 4, vocab=8192, positions=256, seq_len=64),
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-1.3b": _gpt2(64, 1280, 20, seq_len=632),
    # sleeps instead of computing: for measuring schedules (override num_blocks=D, fwd_s=seconds)
    "delay": lambda: {"family": "delay", "config": {"num_blocks": 4, "hidden_size": 16, "fwd_s": 0.05}},
}


def _family(family: str) -> tuple[type, type[LayerChain]]:
    """Config and chain class of ``family``; transformers is imported only for the families that need it
    (importing it costs ~3 s of CPU, paid by every worker process of a delay-model run otherwise)."""
    if family == "bert":
        from transformers import BertConfig

        from chimera.models.bert import BertPretraining

        return BertConfig, BertPretraining
    if family == "gpt2":
        from transformers import GPT2Config

        from chimera.models.gpt2 import GPT2LM

        return GPT2Config, GPT2LM
    return DelayConfig, DelayModel


def build_model(name: str, *, seq_len: int | None = None, corpus: str | None = None, vocab_shards: int = 1,
                **overrides: Any) -> LayerChain:
    """The layer chain of preset ``name``; ``overrides`` set config fields (e.g. ``num_hidden_layers=4``).

    ``vocab_shards`` (GPT-2 presets): the token embedding and the LM head split by vocabulary rows into that many
    layers each (:mod:`chimera.models.vocab`).

    Transformer presets: ``seq_len`` replaces the preset's default sequence length (it must fit the position
    embeddings) and ``corpus`` names the data of :meth:`LayerChain.dataset` (None: synthetic tokens). The delay
    model has no sequence and always reads random regression data.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]()
    if vocab_shards != 1 and preset["family"] != "gpt2":
        raise ValueError(f"vocab_shards={vocab_shards}: only the GPT-2 presets split their embedding and head by "
                         f"vocabulary; {name} is a {preset['family']} preset (use vocab_shards=1)")
    config_cls, chain_cls = _family(preset["family"])
    config = config_cls(**preset["config"])
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"{config_cls.__name__} has no field {key!r} (override for model {name!r})")
        setattr(config, key, value)
    if preset["family"] == "delay":
        return chain_cls(name, config)
    config._attn_implementation = "eager"
    seq_len = preset["seq_len"] if seq_len is None else seq_len
    max_pos = int(config.max_position_embeddings)
    if not 1 <= seq_len <= max_pos:
        raise ValueError(
            f"seq_len={seq_len} does not fit {name} (max_position_embeddings={max_pos}); "
            f"use a seq_len in [1, {max_pos}] or override max_position_embeddings"
        )
    blocks = config.num_hidden_layers if preset["family"] == "bert" else config.n_layer
    if blocks < 1:
        raise ValueError(f"{name} needs at least one transformer block, got {blocks}")
    if preset["family"] == "gpt2":
        return chain_cls(name, config, seq_len, corpus, vocab_shards=vocab_shards)
    return chain_cls(name, config, seq_len, corpus)

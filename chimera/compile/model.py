"""The model pass: the chain and its data, from a preset (``--model``), a user's factory (``--chain
pkg.module:factory``) or a chain handed to the Python API.

    model = resolve_model(cfg)                     # the preset, its vocabulary from the corpus' tokenizer
    model = resolve_model(cfg, chain, data)        # chimera.train(chain, data, ...)
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from chimera.config import ConfigError, TrainConfig
from chimera.data import CorpusError, as_dataset, load_info, resolve_corpus
from chimera.data.pretrain import check_fit
from chimera.microbatch import rows
from chimera.models import PRESETS, ChainError, LayerChain, build_model


@dataclass(frozen=True)
class Model:
    """What to train: the chain, the user's data (None: the chain's own) and the micro-batch size the data has
    (None: the configuration's)."""

    chain: LayerChain
    data: Any = None
    micro_batch_size: int | None = None


def resolve_model(cfg: TrainConfig, chain: LayerChain | None = None, data: Any = None) -> Model:
    """The model of ``cfg``, or ``chain`` and ``data`` from the Python API (module docstring); a chain that cannot
    run its micro-batches is refused here, naming the layer and the shapes it got."""
    model = _model(cfg, chain, data)
    try:
        model.chain.boundaries(model.micro_batch_size or cfg.schedule.micro_batch_size)
    except ChainError as e:
        raise ConfigError(str(e)) from None
    return model


#: vocabulary shards ``--offload auto`` tries, fewest first, when no offload fits a GPT-2 preset unsplit
VOCAB_SPLITS = (2, 4, 8, 16, 32, 64)


def vocab_splittable(cfg: TrainConfig) -> bool:
    """Whether ``--offload auto`` may split this request's model by vocabulary: a GPT-2 preset, ``--vocab-shards``
    not given."""
    m = cfg.model
    return (cfg.memory.offload == "auto" and m.chain is None and "vocab_shards" not in cfg.given
            and m.name in PRESETS and PRESETS[m.name]()["family"] == "gpt2")


def _model(cfg: TrainConfig, chain: LayerChain | None, data: Any) -> Model:
    if cfg.model.vocab_shards != 1 and (chain is not None or cfg.model.chain is not None):
        raise ConfigError(f"--vocab-shards {cfg.model.vocab_shards} splits a GPT-2 preset (--model gpt2-*); for your "
                          "own chain split the model when you make it: chimera.models.decompose.decompose(model, "
                          "vocab_shards=K) or load_pretrained(DIR, vocab_shards=K)")
    if chain is None and cfg.model.chain is not None:
        chain, made = load_chain(cfg.model.chain)
        if data is None and chain.data is None:  # a data factory of the chain numbers samples by this run's N, W
            data = made
    if chain is None:
        return Model(preset_chain(cfg))
    if not isinstance(chain, LayerChain):
        raise ConfigError(f"the model must be a chimera.LayerChain, got {type(chain).__name__}; build one with "
                          "chimera.LayerChain(layers, loss=..., example=...) or chimera.models.decompose")
    if data is None and chain.data is None:
        raise ConfigError(f"{chain.name} has no dataset of its own: pass data (a function (step, micro-batch, "
                          "data-parallel rank) -> (inputs, labels), or a dataset with such a get())")
    size = None
    if data is not None:
        try:
            size = rows(as_dataset(data).get(0, 0, 0))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"data: {e}") from None
    return Model(chain, data, size)


def load_chain(spec: str) -> tuple[LayerChain, Any]:
    """``pkg.module:factory`` -> (chain, data or None): the factory is called without arguments and returns a
    LayerChain or (chain, data). The working directory is importable, as for ``python -m``."""
    module, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--chain {spec}: cannot import {attr!r} from {module!r} ({e}); give 'pkg.module:factory' "
                          "with the package importable from the working directory") from None
    made = factory()
    chain, data = (made if isinstance(made, tuple) and len(made) == 2 else (made, None))
    if not isinstance(chain, LayerChain):
        raise ConfigError(f"--chain {spec} returned {type(chain).__name__}; the factory must return a "
                          "chimera.LayerChain or (chain, data)")
    return chain, data


def preset_chain(cfg: TrainConfig) -> LayerChain:
    """The chain of the preset ``--model``; with a tokenized corpus its vocabulary is the tokenizer's (so every
    process builds the same model) and the corpus must be able to feed ``--seq-len``."""
    m = cfg.model
    if m.name not in PRESETS:
        raise ConfigError(f"--model must be one of {', '.join(sorted(PRESETS))} (or your own with --chain "
                          f"pkg.module:factory), got {m.name!r}")
    model = _build(cfg, dict(m.overrides))
    path = resolve_corpus(m.corpus)
    if path is None or model.family not in ("bert", "gpt2"):
        return model
    try:
        info = load_info(path, model.family)
        note = check_fit(info, model.seq_len)  # type: ignore[attr-defined]
    except CorpusError as e:
        raise ConfigError(f"--corpus: {e}") from None
    if note:
        warnings.warn(note, stacklevel=1)  # one location: shown once per process
    vocab = m.overrides.get("vocab_size", info.vocab_size)
    if vocab != info.vocab_size:
        raise ConfigError(f"model override vocab_size={vocab} contradicts the {info.family} tokenizer of "
                          f"--corpus {m.corpus} ({info.vocab_size} tokens); drop the override")
    return _build(cfg, {**m.overrides, "vocab_size": vocab})


def _build(cfg: TrainConfig, overrides: dict[str, Any]) -> LayerChain:
    m = cfg.model
    try:
        return build_model(m.name, seq_len=m.seq_len, corpus=m.corpus, vocab_shards=m.vocab_shards, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--model {m.name}: {e}") from None

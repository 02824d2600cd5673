"""Pretrained weights in: a local ``save_pretrained`` directory loaded with its own transformers class, decomposed.

Usage::

    from chimera.models.pretrained import load_pretrained
    chain = load_pretrained("runs/gpt2-small", seq_len=128)       # GPT2LMHeadModel, from config.json
    chain = load_pretrained("runs/gpt2-small", vocab_shards=8)    # wte and lm_head as 8 row ranges each
    chimera.train(chain, data, schedule="chimera", stages=4, micro_batches=8)

The class is the first of ``architectures`` in the directory's ``config.json`` and must be one that
:func:`chimera.models.decompose.decompose` splits; nothing is ever fetched from a hub (``local_files_only``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chimera.models.chain import ChainError, DataFactory, Loss
from chimera.models.decompose import DecomposedChain, decompose
from chimera.models.hf import ARCHITECTURES

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class PretrainedError(ChainError):
    """A directory that is not a loadable ``save_pretrained`` directory of a supported architecture."""


def architecture(path: str | Path) -> str:
    """The transformers class named by ``path/config.json`` (its first ``architectures`` entry), checked to be one
    that chimera splits and to have weights next to it."""
    p = Path(path)
    if not p.is_dir():
        raise PretrainedError(f"{p}: no such directory (give a directory written by save_pretrained)")
    config = p / "config.json"
    if not config.is_file():
        raise PretrainedError(f"{p}: no config.json; give a directory written by model.save_pretrained(DIR)")
    try:
        archs = json.loads(config.read_text()).get("architectures") or []
    except ValueError as e:
        raise PretrainedError(f"{config}: not JSON ({e})") from None
    if not archs:
        raise PretrainedError(f"{config} names no architectures; set \"architectures\": [\"GPT2LMHeadModel\"] (one of "
                              f"{', '.join(sorted(ARCHITECTURES))}) or save the model with save_pretrained")
    if archs[0] not in ARCHITECTURES:
        raise PretrainedError(f"{config}: architecture {archs[0]} is not one chimera can split; supported: "
                              f"{', '.join(sorted(ARCHITECTURES))}")
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise PretrainedError(f"{p}: no weights ({' or '.join(WEIGHT_FILES)}); save the model with "
                              "model.save_pretrained(DIR)")
    return str(archs[0])


def load_model(path: str | Path) -> Any:
    """The transformers model saved in ``path`` (its class from ``config.json``), on the CPU, from local files only."""
    import transformers

    arch = architecture(path)
    return getattr(transformers, arch).from_pretrained(str(path), local_files_only=True)


def load_pretrained(path: str | Path, *, seq_len: int = 128, micro_batch_size: int = 2, train: bool = True,
                    name: str | None = None, data: DataFactory | None = None, loss: Loss | None = None,
                    example: tuple[Any, Any] | None = None, vocab_shards: int = 1) -> DecomposedChain:
    """The model saved in ``path`` as a chain (see :func:`chimera.models.decompose.decompose` for the arguments).

    ``train``: dropout on, as in fine-tuning (False: the layers run as in evaluation). The chain's ``source``
    record names ``path`` so that :func:`chimera.export.export` can copy its tokenizer files.
    """
    model = load_model(path)
    model.train(train)
    chain = decompose(model, example=example, loss=loss, name=name, data=data, seq_len=seq_len,
                      micro_batch_size=micro_batch_size, vocab_shards=vocab_shards)
    chain.source["path"] = str(Path(path).resolve())
    return chain

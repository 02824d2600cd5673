"""``text_dataset``: the dataset of a BERT or GPT-2 preset, over a tokenized corpus or synthetic tokens."""

from __future__ import annotations

from pathlib import Path

from chimera.data.base import AddressedDataset
from chimera.data.corpus import TokenizedCorpus, load_info, resolve_corpus
from chimera.data.pretrain import CorpusBertDataset, CorpusGPT2Dataset
from chimera.data.synthetic import SyntheticBertDataset, SyntheticGPT2Dataset

_CLASSES = {"bert": (SyntheticBertDataset, CorpusBertDataset), "gpt2": (SyntheticGPT2Dataset, CorpusGPT2Dataset)}


def text_dataset(family: str, vocab_size: int, seq_len: int, corpus: str | Path | None, micro_batch_size: int,
                 seed: int = 0, microbatches: int = 1, data_parallel: int = 1) -> AddressedDataset:
    """BERT (``family="bert"``) or GPT-2 pretraining micro-batches of ``seq_len`` tokens.

    ``corpus``: ``None`` or ``"synthetic"`` (random tokens), ``"sample"`` (the corpus shipped with chimera) or
    the path of a corpus prepared with ``chimera data tokenizer``. ``microbatches`` and ``data_parallel`` (N and
    W of the run) number the samples so that ranks and micro-batches never share one in an epoch.
    """
    synthetic, from_corpus = _CLASSES[family]
    path = resolve_corpus(corpus)
    if path is None:
        return synthetic(vocab_size, seq_len, micro_batch_size, seed)
    info = load_info(path, family)
    if info.vocab_size != vocab_size:
        raise ValueError(f"the model has vocab_size {vocab_size} but the {family} tokenizer of {path} has "
                         f"{info.vocab_size} tokens (TrainConfig sets the model's from the tokenizer)")
    return from_corpus(TokenizedCorpus(info), seq_len, micro_batch_size, seed, microbatches, data_parallel)

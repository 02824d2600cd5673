"""``build_dataset``: the dataset a training run reads, chosen from the model family and the corpus."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from chimera.data.base import AddressedDataset
from chimera.data.corpus import TokenizedCorpus, load_info, resolve_corpus
from chimera.data.pretrain import CorpusBertDataset, CorpusGPT2Dataset
from chimera.data.synthetic import SyntheticBertDataset, SyntheticGPT2Dataset, SyntheticRegressionDataset

if TYPE_CHECKING:
    from chimera.models.base import LayeredModel


def build_dataset(
    model: LayeredModel, micro_batch_size: int, seq_len: int | None = None, seed: int = 0, *,
    corpus: str | Path | None = None, microbatches: int = 1, data_parallel: int = 1,
) -> AddressedDataset:
    """The dataset for ``model.family``: a tokenized corpus when ``corpus`` names one, else synthetic.

    ``corpus``: ``None`` or ``"synthetic"`` (random tokens), ``"sample"`` (the corpus shipped with chimera)
    or the path of a corpus prepared with ``chimera data tokenizer``. ``microbatches`` and ``data_parallel``
    (N and W of the run) number the samples so that ranks and micro-batches never share one in an epoch.
    ``seq_len`` defaults to the model's. The delay model always gets random regression data.
    """
    seq_len = model.seq_len if seq_len is None else seq_len
    path = resolve_corpus(corpus)
    if model.family == "delay":
        return SyntheticRegressionDataset(model.hidden_size, micro_batch_size, seed)
    if model.family not in ("bert", "gpt2"):
        raise ValueError(f"no dataset for model family {model.family!r}; known: bert, gpt2, delay")
    if path is None:
        cls = SyntheticBertDataset if model.family == "bert" else SyntheticGPT2Dataset
        return cls(model.vocab_size, seq_len, micro_batch_size, seed)
    info = load_info(path, model.family)
    if info.vocab_size != model.vocab_size:
        raise ValueError(f"{model.name} has vocab_size {model.vocab_size} but the {model.family} tokenizer of "
                         f"{path} has {info.vocab_size} tokens (TrainConfig sets the model's from the tokenizer)")
    cls = CorpusBertDataset if model.family == "bert" else CorpusGPT2Dataset
    return cls(TokenizedCorpus(info), seq_len, micro_batch_size, seed, microbatches, data_parallel)

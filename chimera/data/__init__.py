"""Data interface for pipeline training: synthetic datasets and real corpora (Wikipedia → BERT / GPT-2)."""

from chimera.data.base import (
    AddressedDataset,
    FunctionDataset,
    PipelineDataset,
    Units,
    as_dataset,
    mix_seed,
    permute,
)
from chimera.data.build import text_dataset
from chimera.data.corpus import CorpusError, CorpusInfo, TokenizedCorpus, load_info, resolve_corpus
from chimera.data.pretrain import CorpusBertDataset, CorpusGPT2Dataset
from chimera.data.synthetic import SyntheticBertDataset, SyntheticGPT2Dataset

__all__ = [
    "AddressedDataset",
    "CorpusBertDataset",
    "CorpusError",
    "CorpusGPT2Dataset",
    "CorpusInfo",
    "FunctionDataset",
    "PipelineDataset",
    "SyntheticBertDataset",
    "SyntheticGPT2Dataset",
    "TokenizedCorpus",
    "Units",
    "as_dataset",
    "load_info",
    "mix_seed",
    "permute",
    "resolve_corpus",
    "text_dataset",
]

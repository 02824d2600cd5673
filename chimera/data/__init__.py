"""Data interface for pipeline training and synthetic datasets."""

from chimera.data.base import AddressedDataset, PipelineDataset, mix_seed
from chimera.data.synthetic import SyntheticBertDataset, SyntheticGPT2Dataset, build_dataset

__all__ = [
    "AddressedDataset",
    "PipelineDataset",
    "SyntheticBertDataset",
    "SyntheticGPT2Dataset",
    "build_dataset",
    "mix_seed",
]

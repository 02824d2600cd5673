"""Transformer models decomposed into ordered layers, presets, partitioning and pipeline stages."""

from chimera.models.base import LayeredModel, TensorSpec, layer_seed
from chimera.models.bert import BertPretraining
from chimera.models.gpt2 import GPT2LM
from chimera.models.partition import partition
from chimera.models.presets import PRESETS, build_model
from chimera.models.stage import SequentialModel, StageModule, build_stage

__all__ = [
    "PRESETS",
    "BertPretraining",
    "GPT2LM",
    "LayeredModel",
    "SequentialModel",
    "StageModule",
    "TensorSpec",
    "build_model",
    "build_stage",
    "layer_seed",
    "partition",
]

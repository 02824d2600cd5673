"""Models as layer chains (the contract), transformer and delay presets, and pipeline stages (partitioning:
:mod:`chimera.plan.partition`)."""

from typing import Any

from chimera.models.chain import ChainError, LayerChain, TensorSpec, layer_seed
from chimera.models.presets import PRESETS, build_model
from chimera.models.stage import SequentialModel, StageModule, build_stage, unit_seed

__all__ = [
    "PRESETS",
    "BertPretraining",
    "ChainError",
    "GPT2LM",
    "LayerChain",
    "SequentialModel",
    "StageModule",
    "TensorSpec",
    "build_model",
    "build_stage",
    "layer_seed",
    "unit_seed",
]


def __getattr__(name: str) -> Any:
    """``BertPretraining`` and ``GPT2LM`` import transformers, so they load on first use."""
    if name == "BertPretraining":
        from chimera.models.bert import BertPretraining

        return BertPretraining
    if name == "GPT2LM":
        from chimera.models.gpt2 import GPT2LM

        return GPT2LM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

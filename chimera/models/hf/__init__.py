"""transformers architectures that :func:`chimera.models.decompose.decompose` splits into layers.

``ARCHITECTURES`` maps a transformers class name to the function that cuts such a model into its layers (see
:class:`chimera.models.hf.common.Split`); each family module keeps transformers' own submodules inside thin
wrappers, so the chain computes what the model computes. Importing this package imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chimera.models.hf.bert import split_pretraining, split_sequence_classification
from chimera.models.hf.common import Split
from chimera.models.hf.gpt2 import split_lm
from chimera.models.hf.llama import split_causal_lm

#: transformers class name -> the function that splits such a model
ARCHITECTURES: dict[str, Callable[[Any], Split]] = {
    "BertForPreTraining": split_pretraining,
    "BertForSequenceClassification": split_sequence_classification,
    "GPT2LMHeadModel": split_lm,
    "LlamaForCausalLM": split_causal_lm,
}
#: the architectures whose split takes ``vocab_shards`` (embedding and head split by vocabulary rows)
VOCAB_SHARDED = frozenset({"GPT2LMHeadModel"})

__all__ = ["ARCHITECTURES", "VOCAB_SHARDED", "Split"]

"""chimera: Chimera bidirectional pipelines on Ray.

The public API loads on first use (so that ``chimera schedule ...`` does not import torch)::

    import chimera
    model = chimera.LayerChain(layers, loss=..., example=...)
    run = chimera.train(model, data, schedule="chimera", stages=4, micro_batches=8)   # records as they come
    run.model                                                                        # the trained model
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {"LayerChain": "chimera.models", "train": "chimera.api", "build_job": "chimera.api", "Run": "chimera.api",
         "TrainConfig": "chimera.config", "ConfigError": "chimera.config", "compile_job": "chimera.compile"}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'chimera' has no attribute {name!r}")

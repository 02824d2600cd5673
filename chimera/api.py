"""The public Python API: train your own layer chain with any schedule the runtime runs.

    import chimera
    model = chimera.LayerChain(layers, loss=nn.functional.cross_entropy, example=batch(0, 0, 0))
    for rec in chimera.train(model, batch, schedule="chimera", stages=4, micro_batches=8, steps=30):
        print(rec["step"], rec["loss"])

``chimera.train`` runs one process per worker on this machine (no Ray needed); ``ray_launch.train`` takes the
same arguments and runs the workers as Ray actors, locally or across a cluster. ``data`` is a function
``(step, micro_batch, data_parallel_rank) -> (inputs, labels)`` or an object with such a ``get`` method; the
micro-batch size is that of its micro-batches.
"""

from __future__ import annotations

from typing import Any

from chimera.config import ConfigError, TrainConfig
from chimera.data import as_dataset
from chimera.job import Job
from chimera.microbatch import rows
from chimera.models import LayerChain


def chain_job(chain: LayerChain, data: Any, **flags: Any) -> Job:
    """The checked job that trains ``chain`` on ``data``; ``flags`` are :class:`TrainConfig`'s command-line names
    (``schedule``, ``stages``, ``micro_batches``, ``data_parallel``, ``mode``, ``steps``, ``optimizer``, ``lr``...).
    Raises :class:`ConfigError` before anything starts."""
    if not isinstance(chain, LayerChain):
        raise ConfigError(f"chimera.train needs a chimera.LayerChain, got {type(chain).__name__}")
    for name in ("model", "micro_batch_size", "corpus", "seq_len", "model_overrides"):
        if name in flags:
            raise ConfigError(f"{name}= is not an option of chimera.train: the chain and the data define it")
    try:
        samples = rows(as_dataset(data).get(0, 0, 0)) if data is not None else None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"data: {e}") from None
    try:
        cfg = TrainConfig.from_flags(model=chain.name, **flags)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    if samples is not None:
        cfg = cfg.with_flags(micro_batch_size=samples)
    return cfg.check(chain, data)


def train(chain: LayerChain, data: Any = None, **flags: Any) -> list[dict[str, Any]]:
    """Train ``chain`` on ``data`` with one process per worker on this machine; return one record per step
    (``step``, ``loss``, ``step_time_s``, ``samples_per_s``, ``grad_norm``...). See :func:`chain_job`."""
    from chimera.runtime.launch import run_local

    return run_local(chain_job(chain, data, **flags)).metrics

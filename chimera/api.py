"""The public Python API: train a preset or your own layer chain with any schedule the runtime runs.

    import chimera
    model = chimera.LayerChain(layers, loss=nn.functional.cross_entropy, example=batch(0, 0, 0))
    run = chimera.train(model, batch, schedule="chimera", stages=4, micro_batches=8, steps=30)
    run.records[-1]["loss"], run.model # every step's record; the trained model (all layers in one module)
    for rec in chimera.train(model, batch, steps=30, wait=False):   # each record as it is made
        print(rec["step"], rec["loss"])

    chimera.train(model="bert-tiny", stages=2, micro_batches=4, steps=3)    # a preset, as ``chimera train``

The keyword arguments are the fields of :class:`chimera.config.TrainConfig` by their flat names, with the same
defaults as the command line (``config=`` starts from a request read with :func:`chimera.config.load`).
``chimera.train`` runs one process per worker on this machine (no Ray needed); ``ray_launch.train`` takes the same
arguments and runs the workers as Ray actors. ``data`` is a function ``(step, micro_batch, data_parallel_rank) ->
(inputs, labels)`` or an object with such a ``get`` method; the micro-batch size is that of its micro-batches.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from chimera.compile import compile_job, default_run_dir
from chimera.config import ConfigError, TrainConfig
from chimera.job import Job
from chimera.models import LayerChain, SequentialModel
from chimera.runtime.launch import local_steps
from chimera.runtime.reference import stage_params_by_layer
from chimera.timeline.tensorboard import TensorBoardWriter


def request(config: TrainConfig | None = None, **fields: Any) -> TrainConfig:
    """``config`` (default: every field's default) with ``fields`` set by their flat names; ConfigError names an
    unknown one."""
    try:
        return (config or TrainConfig()).with_flags(**fields)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def build_job(chain: LayerChain | None = None, data: Any = None, *, config: TrainConfig | None = None,
        **fields: Any) -> Job:
    """The compiled job that trains ``chain`` on ``data`` (or the preset ``model=``), exactly as ``chimera train``
    builds it from the same fields. Raises :class:`ConfigError` before anything starts."""
    if chain is not None:
        for name in ("model", "micro_batch_size", "corpus", "seq_len", "model_overrides", "chain", "vocab_shards"):
            if name in fields:
                raise ConfigError(f"{name}= is not an option with a chain: the chain and its data define it")
    return compile_job(request(config, **fields), chain, data)


def assemble(job: Job, states: dict[int, dict[tuple[str, int], dict[str, torch.Tensor]]]) -> SequentialModel:
    """One module holding every layer of ``job``'s chain, with the trained parameters of the workers' stages."""
    model = SequentialModel(job.chain, job.run.seed)
    trained: dict[tuple[int, str], torch.Tensor] = {}
    for stages in states.values():
        for (_, stage), params in stages.items():
            trained.update(stage_params_by_layer(params, job.stage_layers[stage]))
    with torch.no_grad():
        for k, layer in enumerate(model.stage.layers):
            for name, p in layer.named_parameters(remove_duplicate=False):
                p.copy_(trained[(model.stage.indices[k], name)])
    return model


class Run:
    """A training run on local processes, started at once in the background (:func:`train`).

    Iterate it for each step's record as it is made; :meth:`wait`, :attr:`model`, ``len`` and indexing wait for the
    end. A worker's failure is raised where the run is read.
    """

    def __init__(self, job: Job, return_model: bool = True) -> None:
        self.job = job
        self.records: list[dict[str, Any]] = []
        self._model: SequentialModel | None = None
        #: with ``tensorboard=True``: where the records go as TensorBoard scalars (``runs/NAME-TIME/tensorboard``)
        self.tensorboard_dir = default_run_dir(job.name) / "tensorboard" if job.timeline.tensorboard else None
        self._board = TensorBoardWriter(self.tensorboard_dir) if self.tensorboard_dir else None
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._done = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(return_model,), daemon=True, name="chimera-run")
        self._thread.start()

    def _run(self, return_model: bool) -> None:
        try:
            for kind, payload in local_steps(self.job, return_state=return_model):
                self._queue.put((kind, payload))
        except BaseException as e:  # raised where the run is read
            self._queue.put(("error", e))
        self._queue.put(("end", None))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every record from the first, each as soon as it is made."""
        read = 0
        while True:
            if read < len(self.records):
                read += 1
                yield self.records[read - 1]
            elif self._done or not self._take():
                if self._error is not None:
                    raise self._error
                return

    def _take(self) -> bool:
        """Handle one message of the background run; False at its end."""
        kind, payload = self._queue.get()
        if kind == "step":
            self.records.append(payload[0])
            if self._board is not None:
                self._board.write(payload[0])
        elif kind == "states":
            self._model = assemble(self.job, payload)
        elif kind == "error":
            self._error = payload
        elif kind == "end":
            self._thread.join()
            if self._board is not None:
                self._board.close()
            self._done = True
            return False
        return True

    def wait(self) -> Run:
        """Run to the end (raises a worker's failure); returns self."""
        for _ in self:
            pass
        if self._error is not None:
            raise self._error
        return self

    @property
    def model(self) -> SequentialModel:
        """The trained model (after the last step)."""
        self.wait()
        if self._model is None:
            raise RuntimeError("the run was started without return_model")
        return self._model

    def __len__(self) -> int:
        return len(self.wait().records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.wait().records[i]


def train(chain: LayerChain | None = None, data: Any = None, *, config: TrainConfig | None = None,
          wait: bool = True, return_model: bool = True, **fields: Any) -> Run:
    """Train with one process per worker on this machine (module docstring). Returns the :class:`Run` when it has
    ended (``wait``; its failure raised here), or at once (``wait=False``: iterate it for the records as they are
    made). Raises :class:`ConfigError` before any worker starts."""
    run = Run(build_job(chain, data, config=config, **fields), return_model)
    return run.wait() if wait else run

"""The worker runtime (no Ray): communication, stage state, compute handlers, executor, worker, a local launcher
and a sequential reference trainer."""

from chimera.runtime.comm import Communicator, StallError
from chimera.runtime.grad_sync import GradBuckets
from chimera.runtime.launch import LocalResult, Verdicts, WorkerError, run_local, summarize_step
from chimera.runtime.reference import Reference, stage_params_by_layer, train_sequential
from chimera.runtime.worker import PipelineWorker, StepResult

__all__ = [
    "Communicator", "GradBuckets", "LocalResult", "PipelineWorker", "Reference", "StallError", "StepResult",
    "Verdicts", "WorkerError", "run_local", "stage_params_by_layer", "summarize_step", "train_sequential",
]

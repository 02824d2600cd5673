"""The worker runtime (no Ray): config, communication, the worker, a local launcher and a reference trainer."""

from chimera.runtime.comm import Communicator, GradBuckets, StallError
from chimera.runtime.config import ConfigError, Plan, TrainConfig, add_train_args, config_from_args
from chimera.runtime.launch import LocalResult, WorkerError, run_local, summarize_step
from chimera.runtime.reference import stage_params_by_layer, train_sequential
from chimera.runtime.worker import PipelineWorker, StepResult

__all__ = [
    "Communicator", "ConfigError", "GradBuckets", "LocalResult", "PipelineWorker", "Plan", "StallError",
    "StepResult", "TrainConfig", "WorkerError", "add_train_args", "config_from_args", "run_local",
    "stage_params_by_layer", "summarize_step", "train_sequential",
]

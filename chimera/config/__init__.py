"""The training request: data in sections, each field declared once. Imports nothing else of chimera.

    from chimera.config import TrainConfig, check_fields, load, dump

    cfg = TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=4)
    check_fields(cfg)                     # ConfigError naming the flag, before anything starts
    cfg, extra = load("run.toml")         # the same sections from a file
    job = chimera.compile.compile_job(cfg)  # the compiler turns a request into the Job the workers run
"""

from chimera.config.checks import ConfigError, check_fields, check_section, type_ok, writable_path
from chimera.config.fields import FieldInfo, Meta, option
from chimera.config.files import dump, load, parse
from chimera.config.sections import (
    FIELDS,
    SECTIONS,
    CheckpointSection,
    MemorySection,
    ModelSection,
    ProfilingSection,
    ScheduleSection,
    TrainConfig,
    TrainingSection,
)

__all__ = ["FIELDS", "SECTIONS", "CheckpointSection", "ConfigError", "FieldInfo", "MemorySection", "Meta",
           "ModelSection", "ProfilingSection", "ScheduleSection", "TrainConfig", "TrainingSection", "check_fields", "check_section",
           "dump", "load", "option", "parse", "type_ok", "writable_path"]

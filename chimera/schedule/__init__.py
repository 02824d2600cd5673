"""Schedules as data: the IR, the registry of schedules, generators, lowering passes, one validator and one
simulator."""

from chimera.schedule import generators as _generators  # noqa: F401  (registers the built-in schedules)
from chimera.schedule import listed as _listed  # noqa: F401  (then the list-ordered ones)
from chimera.schedule.generators import CHIMERA_MODES, chimera, gpipe, interleaved_1f1b, one_f_one_b
from chimera.schedule.io import from_csv, from_json, to_csv, to_json
from chimera.schedule.ir import DOWN, DOWN2, UP, UP2, Action, Kind, Schedule, ScheduleConfigError
from chimera.schedule.listed import bitpipe, chimera4, zb_h1, zb_h2
from chimera.schedule.lowering import (
    add_grad_sync,
    add_optimizer_step,
    add_p2p,
    lower,
    post_validate,
    split_backward,
)
from chimera.schedule.registry import SCHEDULES, ScheduleSpec, build_schedule, candidates, register
from chimera.schedule.simulate import Costs, SimResult, simulate
from chimera.schedule.validate import ScheduleError, format_grid, validate

__all__ = [
    "CHIMERA_MODES", "DOWN", "DOWN2", "SCHEDULES", "UP", "UP2", "Action", "Costs", "Kind", "Schedule",
    "ScheduleConfigError", "ScheduleError", "ScheduleSpec", "SimResult", "add_grad_sync", "add_optimizer_step",
    "add_p2p", "bitpipe", "build_schedule", "candidates", "chimera", "chimera4", "format_grid", "from_csv",
    "from_json", "gpipe", "interleaved_1f1b", "lower", "one_f_one_b", "post_validate", "register", "simulate",
    "split_backward", "to_csv", "to_json", "validate", "zb_h1", "zb_h2",
]

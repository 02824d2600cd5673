"""The names a request may use, from the registries: schedules, Chimera modes, optimizers, learning-rate schedules,
offload levels and model presets. The compiler checks a request against them; the command line lists them.

    choices("schedule")      # ['gpipe', '1f1b', ..., 'auto']
    check_names(cfg)         # ConfigError naming the flag and the allowed names
"""

from __future__ import annotations

from collections.abc import Callable

from chimera.config import FIELDS, ConfigError, TrainConfig
from chimera.models import PRESETS
from chimera.offload.policy import LEVELS, ladder
from chimera.optim import OPTIMIZERS
from chimera.optim import SCHEDULES as LR_SCHEDULES
from chimera.schedule.registry import SCHEDULES, modes

REGISTRIES: dict[str, Callable[[], list[str]]] = {
    "schedule": lambda: [*SCHEDULES, "auto"],
    "mode": lambda: list(modes()),
    "optimizer": lambda: list(OPTIMIZERS),
    "lr_schedule": lambda: list(LR_SCHEDULES),
    "offload": lambda: [lv.name for lv in ladder()] + ["auto"],
    "model": lambda: sorted(PRESETS),
}


def choices(registry: str) -> list[str]:
    """The names registry ``registry`` has now."""
    return REGISTRIES[registry]()


def check_names(cfg: TrainConfig) -> None:
    """Every field whose values come from a registry names one of them (the model preset is checked where the
    model is built: ``--chain`` replaces it)."""
    for name, f in FIELDS.items():
        reg = f.meta.registry
        if not reg or reg == "model":
            continue
        value = cfg.value(name)
        if reg == "offload":
            _check_offload(value)
            continue
        if reg == "schedule" and cfg.schedule.schedule_file is not None:
            continue
        allowed = choices(reg)
        if reg == "schedule":  # aliases and spellings the registry accepts
            from_registry = value.lower().replace("-", "").replace("_", "")
            if value == "auto" or any(from_registry == a.lower().replace("-", "").replace("_", "")
                                      for s in SCHEDULES.values() for a in (s.name, *s.aliases)):
                continue
        if value not in allowed:
            raise ConfigError(f"{f.flag} must be one of {', '.join(allowed)}, got {value!r}")


def _check_offload(text: str) -> None:
    if text == "auto":
        return
    unknown = [p for p in text.split(",") if p.strip() not in LEVELS]
    if unknown:
        names = ", ".join(lv.name for lv in ladder())
        raise ConfigError(f"--offload must be one of {names}, auto, or a comma list with one of {names} per stage "
                          f"(e.g. everything,optimizer,none,none for 4 stages); got {text!r}: "
                          f"{', '.join(map(repr, unknown))} unknown")

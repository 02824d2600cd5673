"""Checks of a request that need nothing but the request: every field's type and bounds, the fixed choices, and
the rules between fields. Names from a registry (schedules, optimizers...) are checked by the compiler.

    check_fields(cfg)            # ConfigError naming the flag and what to change
    type_ok(3, int | None)       # True
"""

from __future__ import annotations

import math
import os
import tempfile
import types
import typing
from typing import Any

from chimera.config.fields import FieldInfo, section_fields
from chimera.config.sections import FIELDS, TrainConfig


class ConfigError(ValueError):
    """An invalid training configuration; the message says what to change."""


def type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the annotated type ``hint`` (bool is not an int; an int is a float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(type_ok(v, args[0]) for v in value)
        return len(value) == len(args) and all(type_ok(v, a) for v, a in zip(value, args))
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, hint)


def type_name(hint: Any) -> str:
    """``int | None`` as a user reads it."""
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("collections.abc.", "").replace("NoneType", "None")


def writable_path(path: str, flag: str, directory: bool) -> None:
    """Raise :class:`ConfigError` unless ``path`` can be written as a file (``directory=False``) or a directory."""
    p = os.path.abspath(path)
    if not directory and os.path.isdir(p):
        raise ConfigError(f"{flag} {path} is a directory; give a file path (e.g. {os.path.join(path, 'run.jsonl')})")
    if directory and os.path.exists(p) and not os.path.isdir(p):
        raise ConfigError(f"{flag} {path} is a file; give a directory")
    parent = p if directory and os.path.isdir(p) else os.path.dirname(p)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    probe = p if directory and os.path.isdir(p) else parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{flag} {path}: {probe} is a file, so nothing can be made under it; choose another path")
    if not _can_write(probe):
        raise ConfigError(f"{flag} {path}: cannot write under {probe} (permission denied); choose a writable path")


def _can_write(directory: str) -> bool:
    """Whether a file can be made in ``directory`` (tried, since root passes every permission test but not a
    read-only filesystem or an immutable directory)."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_field(f: FieldInfo, value: Any) -> None:
    if not type_ok(value, f.type):
        raise ConfigError(f"{f.flag} must be of type {type_name(f.type)}, got {value!r}")
    m = f.meta
    if m.choices and value not in m.choices:
        raise ConfigError(f"{f.flag} must be one of {', '.join(m.choices)}, got {value!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.flag} must be a finite number, got {value}")
        if m.minimum is not None and value < m.minimum:
            raise ConfigError(f"{f.flag} must be >= {m.minimum:g}, got {value}")
        if m.maximum is not None and value > m.maximum:
            raise ConfigError(f"{f.flag} must be <= {m.maximum:g}, got {value}")


def check_section(name: str, obj: Any) -> None:
    """Every field of another layer's section (a dataclass declared with ``option``): type, choices, bounds."""
    for f in section_fields(name, type(obj), {}):
        _check_field(f, getattr(obj, f.name))


def check_fields(cfg: TrainConfig) -> None:
    """Every field on its own, then the rules between fields; messages name the flag and what to change."""
    for name, f in FIELDS.items():
        _check_field(f, cfg.value(name))
    s, t, m, p, c = cfg.schedule, cfg.training, cfg.memory, cfg.profiling, cfg.checkpoint
    _need(t.lr > 0, f"--lr must be > 0, got {t.lr}")
    _need(s.mode != "halving" or s.micro_batch_size % 2 == 0,
          f"--mode halving trains on halves of every micro-batch: --micro-batch-size must be even, got "
          f"{s.micro_batch_size}")
    _need(m.offload_pack == 0 or m.offload == "auto" or "everything" in m.offload,
          f"--offload-pack {m.offload_pack} swaps weights in packs: give --offload everything (for some stage) or "
          f"auto, got --offload {m.offload}")
    _need(m.offload != "auto" or m.memory_per_worker is not None,
          "--offload auto chooses the least offload that fits --memory-per-worker: give that budget too")
    _need(c.every == 0 or c.dir is not None, "--checkpoint-every needs --checkpoint-dir DIR (where the checkpoints go)")
    _need(c.keep_last == 0 or c.dir is not None, "--keep-last needs --checkpoint-dir DIR (where the checkpoints go)")
    if c.dir is not None:
        writable_path(c.dir, "--checkpoint-dir", directory=True)
    _need(s.schedule_file is None or s.plan is None, "--schedule-file and --plan both choose the schedule: give one")
    _need(cfg.model.chain is None or ":" in cfg.model.chain,
          f"--chain takes 'pkg.module:factory' (a function returning the chain), got {cfg.model.chain!r}")
    bad = [x for x in p.profile_steps if not 0 <= x < t.steps]
    _need(not bad, f"--profile-steps {bad} are outside 0..{t.steps - 1}; raise --steps or pick other steps")

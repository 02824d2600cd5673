"""Config files: the request's sections as TOML, read and written from the field declarations.

    cfg, extra = load("run.toml", extra={"launch": LaunchConfig})   # unknown key or wrong type: ConfigError
    text = dump(cfg, {"launch": launch})                            # what --config reads back to the same request

A file holds ``[model]``, ``[schedule]``, ``[training]``, ``[memory]``, ``[profiling]`` and ``[checkpoint]`` tables
whose keys are the fields' names (``[schedule] stages = 4``); the Ray layer adds its own tables (``[launch]``).
Every key a file sets counts as given by the user (``TrainConfig.given``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chimera.config.checks import ConfigError, type_name, type_ok
from chimera.config.fields import section_fields
from chimera.config.sections import RENAMED, SECTIONS, TrainConfig


def _from_toml(value: Any, hint: Any) -> Any:
    """TOML has arrays where the fields have tuples."""
    if isinstance(value, list) and not type_ok(value, hint):
        return tuple(_from_toml(v, Any) for v in value)
    return value


def _section(name: str, cls: type, table: Any, source: str) -> tuple[Any, set[str]]:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{name}] must be a table of keys, got {type(table).__name__}")
    fields = {f.name: f for f in section_fields(name, cls, RENAMED.get(name, {}))}
    values: dict[str, Any] = {}
    for key, raw in table.items():
        if key not in fields:
            raise ConfigError(f"{source}: unknown key {key!r} in [{name}]; known: {', '.join(sorted(fields))}")
        f = fields[key]
        value = _from_toml(raw, f.type)
        if not type_ok(value, f.type):
            raise ConfigError(f"{source}: [{name}] {key} must be of type {type_name(f.type)}, got {raw!r}")
        values[key] = value
    return cls(**values), {fields[k].flat for k in values}


def parse(text: str, source: str = "config", extra: Mapping[str, type] | None = None
          ) -> tuple[TrainConfig, dict[str, Any]]:
    """A request and the ``extra`` sections (name -> dataclass; each made from its table or its defaults)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source} is not valid TOML: {e}") from None
    extra = dict(extra or {})
    known = {**SECTIONS, **extra}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{source}: unknown section [{unknown[0]}]; known: {', '.join(f'[{k}]' for k in known)}")
    parts: dict[str, Any] = {}
    given: set[str] = set()
    for name, cls in known.items():
        parts[name], keys = _section(name, cls, data.get(name, {}), source)
        if name in SECTIONS:
            given |= keys
    cfg = TrainConfig(**{k: parts[k] for k in SECTIONS}, given=frozenset(given))
    return cfg, {k: parts[k] for k in extra}


def load(path: str | Path, extra: Mapping[str, type] | None = None) -> tuple[TrainConfig, dict[str, Any]]:
    """Read a config file (:func:`parse`); ConfigError when it is missing or wrong, naming the key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file; write one with the sections of `chimera train --help`, "
                          "or take the config.toml a run wrote next to its metrics")
    return parse(p.read_text(), str(path), extra)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"cannot write {v!r} ({type(v).__name__}) to a config file")


def _table(name: str, obj: Any) -> list[str]:
    lines = [f"[{name}]"]
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is None:  # TOML has no null: a missing key is its default
            if f.default is not None:
                raise ConfigError(f"cannot write [{name}] {f.name} = None: its default is {f.default!r}")
            continue
        lines.append(f"{f.name} = {_value(v)}")
    return lines


def dump(cfg: TrainConfig, extra: Mapping[str, Any] | None = None) -> str:
    """The request (and ``extra`` sections) as TOML that :func:`parse` reads back to equal values."""
    lines = ["# chimera training configuration: chimera train --config THIS_FILE (flags override it)"]
    for name in SECTIONS:
        lines += ["", *_table(name, getattr(cfg, name))]
    for name, obj in (extra or {}).items():
        lines += ["", *_table(name, obj)]
    return "\n".join(lines) + "\n"

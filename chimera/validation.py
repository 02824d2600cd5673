"""Checks shared by the configuration's sections: the error type, value types against annotations, paths.

    type_ok(3, int | None)                                    # True
    writable_path("out/run.jsonl", "--out", directory=False)  # ConfigError when a directory or not writable
"""

from __future__ import annotations

import os
import types
import typing
from typing import Any


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
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot write under {parent} (permission denied); choose a writable path")

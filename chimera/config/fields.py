"""Fields declared once: type (the annotation), default, unit, choices, help, the flag and its old spellings.

The command line (``chimera.cli.options``), the config file (:mod:`chimera.config.files`) and the checks read these
declarations; nothing copies them by hand::

    @dataclass(frozen=True)
    class ScheduleSection:
        stages: int = option(4, "pipeline depth D (workers per pipeline)", short="-D", minimum=1)

    meta(ScheduleSection, "stages").help      # 'pipeline depth D (workers per pipeline)'
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Meta:
    """What a field means beyond its type and default.

    Attributes:
        help: one line for ``--help`` and the docs.
        unit: the unit of a number (``seconds``, ``bytes``, ``steps``...), shown with the default.
        choices: the values allowed when they are fixed here.
        registry: the registry whose names are the allowed values (``schedule``, ``optimizer``, ``lr_schedule``,
            ``offload``, ``model``, ``mode``); the compiler checks them, the command line lists them.
        flag: the flag, when it is not ``--`` + the field's name with dashes.
        short: a one-letter flag (``-D``).
        deprecated: older spellings, accepted for one release with a warning.
        cli: False for fields set from Python or a file only (fault injection, nested values).
        minimum / maximum: bounds of a number (inclusive), checked before anything starts.
    """

    help: str
    unit: str = ""
    choices: tuple[str, ...] = ()
    registry: str = ""
    flag: str = ""
    short: str = ""
    deprecated: tuple[str, ...] = ()
    cli: bool = True
    minimum: float | None = None
    maximum: float | None = None


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           **meta: Any) -> Any:
    """A dataclass field with its :class:`Meta` (``default`` or ``factory`` for mutable defaults)."""
    kw: dict[str, Any] = {"metadata": {"meta": Meta(help, **meta)}}
    if factory is not None:
        kw["default_factory"] = factory
    else:
        kw["default"] = default
    return dataclasses.field(**kw)


def meta(cls: type, name: str) -> Meta:
    """The :class:`Meta` of field ``name`` of section class ``cls``."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("meta") or Meta("")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


@dataclass(frozen=True)
class FieldInfo:
    """One field of one section, with everything the command line and the files need."""

    section: str
    name: str
    flat: str  # the name in the flat namespace (keyword arguments, flag destination)
    type: Any
    default: Any
    meta: Meta

    @property
    def flag(self) -> str:
        return self.meta.flag or "--" + self.flat.replace("_", "-")

    @property
    def key(self) -> str:
        """``[section] name`` as a config file spells it."""
        return f"[{self.section}] {self.name}"


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def section_fields(section: str, cls: type, flat_names: dict[str, str]) -> Iterator[FieldInfo]:
    """Every field of a section class; ``flat_names`` renames fields whose flat name is not their own."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        m = f.metadata.get("meta") or Meta("")
        yield FieldInfo(section, f.name, flat_names.get(f.name, f.name), hints[f.name], default_of(f), m)

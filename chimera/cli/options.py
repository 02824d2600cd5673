"""Command-line flags generated from the request's field declarations (:mod:`chimera.config.sections`): one group
per section, defaults and units shown, the registries' names listed, the same flag for the same concept in every
subcommand, older spellings accepted with a warning for one release.

    p = parser("chimera train", "Train a model with pipeline parallelism.")
    add_config_args(p)                                  # every field, grouped by section
    cfg = config_from_args(p.parse_args(argv))          # --config FILE first, then the flags given
    add_field(q, "stages", required=True)              # one concept in another subcommand: the same flag
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from chimera.config import FIELDS, SECTIONS, ConfigError, FieldInfo, TrainConfig, load
from chimera.config.fields import section_fields
from chimera.offload.policy import ladder
from chimera.schedule.registry import SCHEDULES, modes

#: a registry's names by its name; the light ones are here, the compiler's (``chimera.compile.names.choices``,
#: which load torch) are handed in by the commands that train, plan or profile
Names = Callable[[str], list[str]]


def light_names(registry: str) -> list[str]:
    """The names of the registries that load without torch (schedules, modes, offload levels); [] for others."""
    table: dict[str, Callable[[], list[str]]] = {"schedule": lambda: [*SCHEDULES, "auto"], "mode": lambda: list(modes()),
                                                 "offload": lambda: [lv.name for lv in ladder()] + ["auto"]}
    return table[registry]() if registry in table else []


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """No abbreviations (``--addr`` is not ``--address``), defaults in the help, errors as one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def parser(prog: str, description: str) -> Parser:
    return Parser(prog=prog, description=description)


def _deprecated(base: type[argparse.Action], new: str) -> type[argparse.Action]:
    class Deprecated(base):  # type: ignore[valid-type, misc]
        def __call__(self, p: Any, ns: Any, values: Any, option_string: str | None = None) -> None:
            print(f"warning: {option_string} is deprecated: use {new} (the old spelling goes in the next release)",
                  file=sys.stderr)
            super().__call__(p, ns, values, option_string)

    return Deprecated


def _unwrap(hint: Any) -> Any:
    """``int | None`` -> int."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def int_list(text: str) -> tuple[int, ...]:
    """``5,6,7`` -> (5, 6, 7), sorted, duplicates dropped."""
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 5,6,7, got {text!r}") from None


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def help_of(f: FieldInfo, default: Any, names_of: Names = light_names) -> str:
    """The field's help with its allowed names, default and unit."""
    text = f.meta.help
    listed = f.meta.registry and f.meta.registry != "offload"  # offload's help says its names and forms
    names = list(f.meta.choices) or (names_of(f.meta.registry) if listed else [])
    if names:
        text += f"; one of {', '.join(names)}"
    unit = f" {f.meta.unit}" if f.meta.unit and default is not None else ""
    return f"{text} (default: {_shown(default)}{unit})"


class _Append(argparse.Action):
    """A repeatable flag whose values gather into a tuple."""

    def __call__(self, p: Any, ns: Any, values: Any, option_string: str | None = None) -> None:
        setattr(ns, self.dest, (*(getattr(ns, self.dest, None) or ()), values))


def _kwargs(f: FieldInfo, names_of: Names) -> dict[str, Any]:
    hint = _unwrap(f.type)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    kw: dict[str, Any] = {}
    origin = typing.get_origin(hint)
    if origin is tuple and typing.get_args(hint)[0] is str:
        kw["action"] = _Append
    elif origin is tuple:
        kw.update(type=int_list, metavar="N,N,...")
    elif hint in (int, float):
        kw["type"] = hint
    if f.meta.choices:
        kw["choices"] = f.meta.choices
    elif f.meta.registry in ("mode", "optimizer", "lr_schedule") and names_of(f.meta.registry):
        kw["choices"] = names_of(f.meta.registry)
    return kw


def add_field(p: Any, flat: str | FieldInfo, *, default: Any = argparse.SUPPRESS, required: bool = False,
              help: str | None = None, names_of: Names = light_names) -> None:
    """Field ``flat`` (a request field's flat name, or any section's field) as a flag of ``p`` (a parser or an
    argument group), with its short form and old spellings. ``default`` SUPPRESS (the default): absent from the
    namespace unless given, so that a config file's value stands; ``help``: a subcommand's own wording;
    ``names_of``: the registries' names to list."""
    f = FIELDS[flat] if isinstance(flat, str) else flat
    kw = _kwargs(f, names_of)
    shown = f.default if default is argparse.SUPPRESS else default
    names = [f.flag] + ([f.meta.short] if f.meta.short else [])
    p.add_argument(*names, dest=f.flat, default=default, required=required,
                   help=(f"{help} (default: {_shown(shown)})" if help else help_of(f, shown, names_of)), **kw)
    if f.meta.deprecated:
        base = kw.get("action") or argparse._StoreAction
        extra = {k: v for k, v in kw.items() if k != "action"}
        p.add_argument(*f.meta.deprecated, dest=f.flat, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                       action=_deprecated(base, f.flag), **extra)


def deprecated_alias(p: Any, old: str, new: str, dest: str, **kw: Any) -> None:
    """``old`` accepted as ``new`` with a warning (a subcommand's own renamed flag)."""
    base = argparse._StoreTrueAction if kw.pop("flag", False) else argparse._StoreAction
    p.add_argument(old, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, action=_deprecated(base, new),
                   **kw)


def add_config_args(p: argparse.ArgumentParser, names_of: Names = light_names) -> None:
    """``--config FILE`` and every field of every section, one argument group per section."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="read the sections from this TOML file first; flags override it (default: none)")
    for section, cls in SECTIONS.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        group = p.add_argument_group(f"[{section}]", doc)
        for name, f in FIELDS.items():
            if f.section == section and f.meta.cli:
                add_field(group, name, names_of=names_of)


def add_section_args(p: argparse.ArgumentParser, name: str, cls: type) -> None:
    """Every field of another layer's section (``[launch]``) as flags, in an argument group of its own."""
    group = p.add_argument_group(f"[{name}]", (cls.__doc__ or "").strip().splitlines()[0])
    for f in section_fields(name, cls, {}):
        if f.meta.cli:
            add_field(group, f)


def section_from_args(ns: argparse.Namespace, name: str, base: Any) -> Any:
    """``base`` (a section from a config file, or its defaults) with the flags given for its fields."""
    given = {f.name: getattr(ns, f.flat) for f in section_fields(name, type(base), {}) if hasattr(ns, f.flat)}
    return dataclasses.replace(base, **given)


def config_from_args(ns: argparse.Namespace, extra: dict[str, type] | None = None
                     ) -> tuple[TrainConfig, dict[str, Any]]:
    """The request of parsed flags: the ``--config`` file's sections (and ``extra`` ones), then every flag given
    (unknown names, such as a launcher's, are left to their owner)."""
    path = getattr(ns, "config", None)
    if path:
        cfg, parts = load(path, extra)
    else:
        cfg, parts = TrainConfig(), {k: cls() for k, cls in (extra or {}).items()}
    given = {k: v for k, v in vars(ns).items() if k in FIELDS}
    try:
        return cfg.with_flags(**given), parts
    except TypeError as e:
        raise ConfigError(str(e)) from None


def flags_of(names: Sequence[str]) -> list[str]:
    """The flags of fields, for messages."""
    return [FIELDS[n].flag for n in names]

"""The schedules the runtime runs, one registry entry each: how to build it, which (D, N) it accepts and why not,
whether it always splits the backward, its Chimera modes, its chunks, the shares of the model a worker holds, and
how its pipeline fills (the planner's lower bound). ``--schedule``, ``auto``, the planner, the flag help and
``chimera schedule`` all read this table; adding a schedule is one module with its builder and one
:func:`register` call::

    register(ScheduleSpec("my-1f1b", build=my_builder, help="1F1B with a longer warm-up", shares=1))
    build_schedule("my-1f1b", stages=4, microbatches=8)

A builder is called as ``build(stages, microbatches, **options)`` with the options of :meth:`ScheduleSpec.variants`
(``mode``, ``chunks``, ``split_backward``, ``reverse_backward``, ``order_costs``: each only if the spec declares it)
and returns a compute-only :class:`~chimera.schedule.ir.Schedule`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from chimera.schedule.ir import Schedule, ScheduleConfigError, _replace
from chimera.schedule.lowering import split_backward as split_in_place


def _any(stages: int, microbatches: int, options: dict[str, Any]) -> str | None:
    return None


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule (module docstring).

    Attributes:
        name: what ``--schedule`` takes.
        build: the builder.
        help: one line for the flag help and the docs.
        aliases: other spellings (``-`` and ``_`` are ignored anyway).
        accepts: why the schedule cannot be built for (D, N, options), or None.
        backward: the backward forms ``auto`` and the planner try: whole (False) and split (True) into I and W;
            ``(True,)``: the builder always splits (it has no whole-backward form).
        modes: Chimera's N > D modes it takes (``mode`` option); empty: none.
        chunks: stages per worker and pipe: None (one), ``"option"`` (``--chunks``, default 2) or a fixed number.
        shares: the shares of the model (1/D each) a worker holds: weights, gradients and optimizer state.
        auto: ``--schedule auto`` considers it (the planner considers every searched schedule).
        searched: ``auto`` and the planner may consider it; False: built only when named (and ranked by
            ``schedule best --rank-by period``).
        takes: the builder's keyword options beyond (stages, microbatches).
        frame: the schedule without its order, for the planner's bound (:func:`frame_schedule`): called like
            ``build`` (with the same options), it returns a Schedule with the placement, micro-batch units and
            scale the builder's has and no actions; None: the built schedule's own, its actions dropped (for a
            builder whose order costs little).
    """

    name: str
    build: Callable[..., Schedule]
    help: str = ""
    aliases: tuple[str, ...] = ()
    accepts: Callable[[int, int, dict[str, Any]], str | None] = _any
    backward: tuple[bool, ...] = (False, True)
    modes: tuple[str, ...] = ()
    chunks: int | str | None = None
    shares: int | Fraction = 1
    auto: bool = True
    searched: bool = True
    takes: tuple[str, ...] = field(default=())
    frame: Callable[..., Schedule] | None = None

    @property
    def split_only(self) -> bool:
        """The builder always splits the backward."""
        return self.backward == (True,)

    def parts(self, stages: int, options: dict[str, Any]) -> int:
        """The stages the model is cut into for D = ``stages``."""
        return stages * self.chunks_of(options)

    def chunks_of(self, options: dict[str, Any]) -> int:
        if self.chunks is None:
            return 1
        return int(options.get("chunks", 2)) if self.chunks == "option" else int(self.chunks)

    def variants(self, stages: int, microbatches: int, split: bool, halving: bool = True) -> list[dict[str, Any]]:
        """The build options ``auto`` and the planner try for (D, N) with a whole (``split`` False) or split
        backward; [] where the schedule does not build there."""
        if split not in self.backward:
            return []
        out = []
        for mode in self.modes or (None,):
            if mode == "halving" and not halving:
                continue
            options: dict[str, Any] = {"split_backward": split}
            if mode is not None:
                options["mode"] = mode
            if self.chunks is not None:
                options["chunks"] = self.chunks_of({})
            if self.accepts(stages, microbatches, options) is None:
                out.append(options)
        return out

    def label(self, options: dict[str, Any]) -> str:
        """The flags of a variant: ``chimera --mode halving --split-backward``."""
        text = self.name
        if "mode" in options and self.modes:
            text += f" --mode {options['mode']}"
        if self.chunks == "option":
            text += f" --chunks {self.chunks_of(options)}"
        if options.get("split_backward") and not self.split_only:
            text += " --split-backward"
        return text


SCHEDULES: dict[str, ScheduleSpec] = {}


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add a schedule (or replace one of the same name)."""
    taken = {_key(a): s.name for s in SCHEDULES.values() if s.name != spec.name for a in (s.name, *s.aliases)}
    clash = [a for a in (spec.name, *spec.aliases) if _key(a) in taken]
    if clash:
        raise ValueError(f"schedule {spec.name!r}: the name {clash[0]!r} is taken by {taken[_key(clash[0])]!r}")
    SCHEDULES[spec.name] = spec
    return spec


def get(name: str) -> ScheduleSpec:
    """The registered schedule called ``name`` (or an alias); ScheduleConfigError lists the known ones."""
    key = _key(name)
    for spec in SCHEDULES.values():
        if key in {_key(a) for a in (spec.name, *spec.aliases)}:
            return spec
    raise ScheduleConfigError(f"unknown schedule {name!r}; allowed: {', '.join(SCHEDULES)}")


def modes() -> tuple[str, ...]:
    """Every mode any schedule takes, in registration order."""
    return tuple(dict.fromkeys(m for s in SCHEDULES.values() for m in s.modes))


def build_schedule(name: str, stages: int, microbatches: int, *, data_parallel: int = 1,
                   split_backward: bool = False, **options: Any) -> Schedule:
    """Build a compute-only schedule by name; ``options`` the spec takes (``mode``, ``chunks``, ``order_costs``,
    ``reverse_backward``; others are ignored). ``split_backward``: every backward as its parts I and W (a
    schedule whose builder orders them itself takes it as an option; others get W right after I).

    Raises :class:`ScheduleConfigError` with a one-line message for unsupported parameters."""
    spec, given = _checked(name, stages, microbatches, data_parallel, split_backward, options)
    s = spec.build(stages, microbatches, **given)
    if split_backward:  # a no-op where the builder split the backward itself
        s = split_in_place(s)
    return s.with_data_parallel(data_parallel)


#: schedules :func:`cached_build` keeps, newest last, while their actions number at most ``_KEEP_ACTIONS``
_BUILT: OrderedDict[tuple[Any, ...], Schedule] = OrderedDict()
_KEEP_ACTIONS = 4_000_000
_FRESH = False  # fresh_builds()


def cached_build(name: str, stages: int, microbatches: int, *, data_parallel: int = 1,
                 split_backward: bool = False, **options: Any) -> Schedule:
    """:func:`build_schedule`, remembered: the same schedule, options and (D, N) give the same action lists without
    building them again, as long as they are among the most recent builds (up to four million actions in all);
    any data-parallel width shares them. Options count as the builder takes them (an option it ignores, or one
    at its default, is the same as none); ``order_costs`` by every field, up to a common factor where none is a
    float (an order made with costs c is the one made with k*c: every time scales by k)."""
    if _FRESH:
        return build_schedule(name, stages, microbatches, data_parallel=data_parallel, split_backward=split_backward,
                              **options)
    spec = get(name)
    defaults = _defaults(spec)
    given = {k: options.get(k, defaults.get(k)) for k in spec.takes if k != "split_backward"}
    key = (spec.name, stages, microbatches, split_backward, tuple(sorted((k, _hashable(v)) for k, v in given.items())))
    s = _BUILT.get(key)
    if s is None:
        s = _BUILT[key] = build_schedule(name, stages, microbatches, split_backward=split_backward, **options)
        total = sum(sum(len(row) for row in b.actions) for b in _BUILT.values())
        while len(_BUILT) > 1 and total > _KEEP_ACTIONS:
            _, old = _BUILT.popitem(last=False)
            total -= sum(len(row) for row in old.actions)
    else:
        _BUILT.move_to_end(key)
    return s if data_parallel == 1 else s.with_data_parallel(data_parallel)


def _defaults(spec: ScheduleSpec) -> dict[str, Any]:
    """The builder's keyword defaults."""
    return {k: p.default for k, p in inspect.signature(spec.build).parameters.items()
            if p.default is not inspect.Parameter.empty}


@contextmanager
def fresh_builds() -> Iterator[None]:
    """Within it, :func:`cached_build` builds every schedule afresh (what the planner's reference path compares
    the cache with)."""
    global _FRESH
    before, _FRESH = _FRESH, True
    try:
        yield
    finally:
        _FRESH = before


def _hashable(value: Any) -> Any:
    """A key for an option value; order costs (:class:`~chimera.schedule.simulate.Costs`) by every field, their
    numbers up to a common factor where none is a float (:func:`cached_build`)."""
    if not dataclasses.is_dataclass(value):
        return value

    def leaves(v: Any) -> list[Any]:
        return [x for y in v for x in leaves(y)] if isinstance(v, list | tuple) else [v]

    fields = [getattr(value, f.name) for f in dataclasses.fields(value)]
    numbers = [x for x in leaves(fields) if isinstance(x, int | float | Fraction) and not isinstance(x, bool)]
    exact = not any(isinstance(x, float) for x in numbers)
    unit = next((Fraction(x) for x in numbers if x), Fraction(1)) if exact else Fraction(1)

    def norm(v: Any) -> Any:
        if isinstance(v, list | tuple):
            return tuple(norm(x) for x in v)
        if exact and isinstance(v, int | Fraction) and not isinstance(v, bool):
            return Fraction(v) / unit
        return v

    return type(value).__name__, norm(fields)


def frame_schedule(name: str, stages: int, microbatches: int, *, data_parallel: int = 1,
                   split_backward: bool = False, **options: Any) -> Schedule:
    """What :func:`build_schedule` would build, without ordering its actions: the same stages, placement,
    micro-batch units, scale and data-parallel width, and one empty action list per worker (what the planner
    bounds a candidate with before it pays for the order). Raises the same ScheduleConfigError where the
    parameters are refused; not a schedule to run or simulate."""
    spec, given = _checked(name, stages, microbatches, data_parallel, split_backward, options)
    s = spec.frame(stages, microbatches, **given) if spec.frame else spec.build(stages, microbatches, **given)
    return _replace(s, actions=[()] * s.workers, data_parallel=data_parallel)


def _checked(name: str, stages: int, microbatches: int, data_parallel: int, split_backward: bool,
             options: dict[str, Any]) -> tuple[ScheduleSpec, dict[str, Any]]:
    """The spec and the builder's options, or ScheduleConfigError for parameters it refuses."""
    spec = get(name)
    if data_parallel < 1:
        raise ScheduleConfigError(f"--data-parallel (W) must be >= 1, got {data_parallel}")
    if stages < 1:
        raise ScheduleConfigError(f"--stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ScheduleConfigError(f"--micro-batches must be >= 1, got {microbatches}")
    given = {k: v for k, v in options.items() if k in spec.takes and v is not None}
    if "split_backward" in spec.takes:
        given["split_backward"] = split_backward
    why = spec.accepts(stages, microbatches, {**given, "split_backward": split_backward})
    if why:
        raise ScheduleConfigError(why)
    return spec, given


def candidates(stages: int, microbatches: int, halving: bool = True, auto_only: bool = True, steady: bool = False
               ) -> list[tuple[str, ScheduleSpec, dict[str, Any]]]:
    """(label, spec, options) of every variant that builds for (D, N): whole-backward variants first, then split
    ones, each in registration order. ``halving``: include Chimera's backward halving; ``auto_only``: only the
    schedules ``--schedule auto`` considers (the planner takes them all); ``steady``: also those built only when
    named (``searched=False``), which ``schedule best --rank-by period`` ranks."""
    out = []
    for split in (False, True):
        for spec in SCHEDULES.values():
            if (not spec.searched and not steady) or (auto_only and not spec.auto):
                continue
            out += [(spec.label(o), spec, o) for o in spec.variants(stages, microbatches, split, halving)]
    return out

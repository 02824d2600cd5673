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

from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from chimera.schedule.ir import Schedule, ScheduleConfigError
from chimera.schedule.lowering import split_backward as split_in_place


def _any(stages: int, microbatches: int, options: dict[str, Any]) -> str | None:
    return None


def _fill_one_pipe(stages: int, options: dict[str, Any]) -> float:
    return (stages - 1) / stages


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
        fill: the fraction of one forward through the whole model that the worker starting last waits before its
            first input (the planner's lower bound), for (D, options).
        auto: ``--schedule auto`` considers it (the planner considers every schedule).
        takes: the builder's keyword options beyond (stages, microbatches).
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
    fill: Callable[[int, dict[str, Any]], float] = _fill_one_pipe
    auto: bool = True
    takes: tuple[str, ...] = field(default=())

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
    s = spec.build(stages, microbatches, **given)
    if split_backward:  # a no-op where the builder split the backward itself
        s = split_in_place(s)
    return s.with_data_parallel(data_parallel)


def candidates(stages: int, microbatches: int, halving: bool = True, auto_only: bool = True
               ) -> list[tuple[str, ScheduleSpec, dict[str, Any]]]:
    """(label, spec, options) of every variant that builds for (D, N): whole-backward variants first, then split
    ones, each in registration order. ``halving``: include Chimera's backward halving; ``auto_only``: only the
    schedules ``--schedule auto`` considers (the planner takes them all)."""
    out = []
    for split in (False, True):
        for spec in SCHEDULES.values():
            if auto_only and not spec.auto:
                continue
            out += [(spec.label(o), spec, o) for o in spec.variants(stages, microbatches, split, halving)]
    return out

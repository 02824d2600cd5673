"""The schedule IR: small immutable actions and a schedule that places them on workers.

An :class:`Action` is ``(kind, pipe, stage, microbatch)``; a :class:`Schedule` is the placement
``(pipe, stage) -> worker`` plus one ordered action list per worker of one data-parallel group (all W
groups run identical lists). Generators emit compute-only lists (F and B); :mod:`chimera.schedule.lowering`
adds communication, gradient synchronisation and the optimizer step.

Text form (compatible with ``torch.distributed.pipelining`` for single-direction schedules)::

    0F3        stage 0, forward, micro-batch 3 (pipe "down" implied)
    u2B1       up pipe, stage 2, backward, micro-batch 1
    D1I0       second down pipe (four-pipe Chimera; U: second up pipe), stage 1, input-gradient backward, mb 0
    d0F2-3     one forward over micro-batches 2 and 3 at once (Chimera forward doubling)
    d1RECV_F3  receive the activation that stage 1 needs for micro-batch 3
    d0AR_START start the gradient allreduce of stage 0 (this worker's replica in the down pipe)
    OPT        optimizer step

Example::

    >>> from chimera.schedule import build_schedule
    >>> s = build_schedule("chimera", stages=4, microbatches=4)
    >>> " ".join(a.text(s.bidirectional) for a in s.actions[0])
    'd0F0 d0F1 u3F0 u3B0 u3F1 u3B1 d0B0 d0B1'
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property

from chimera.schedule.kinds import KIND_OF_CODE, SPECS, VERSION, Address, Kind

DOWN = "down"
UP = "up"
DOWN2 = "down2"  # Chimera with four pipelines: a second down pipe, shifted by D/2 workers
UP2 = "up2"  # and a second up pipe, shifted likewise
PIPES = (DOWN, UP, DOWN2, UP2)
PIPE_PREFIX = {DOWN: "d", UP: "u", DOWN2: "D", UP2: "U"}
DIRECTION = {DOWN: DOWN, UP: UP, DOWN2: DOWN, UP2: UP}  # which way each pipe runs over the workers
PREFIX_PIPE = {v: k for k, v in PIPE_PREFIX.items()}
_PREFIXES = "".join(PIPE_PREFIX.values())


def _codes(address: Address) -> str:
    return "|".join(sorted((s.code for s in SPECS.values() if s.address is address), key=len, reverse=True))


_PATTERNS: dict[int, tuple[re.Pattern[str], re.Pattern[str], dict[str, Kind]]] = {}


def _patterns() -> tuple[re.Pattern[str], re.Pattern[str], dict[str, Kind]]:
    """The text form's patterns, made from the kinds table as it is now (a registered kind joins them)."""
    v = VERSION[0]
    if v not in _PATTERNS:
        _PATTERNS.clear()
        _PATTERNS[v] = (re.compile(rf"^([{_PREFIXES}]?)(\d+)({_codes(Address.MICROBATCH)})(\d+)(?:-(\d+))?$"),
                        re.compile(rf"^([{_PREFIXES}]?)(\d+)({_codes(Address.STAGE)})$"),
                        {s.code: k for k, s in SPECS.items() if s.address is Address.NONE})
    return _PATTERNS[v]


class ScheduleConfigError(ValueError):
    """A schedule was asked for with parameters it does not support; the message says what is allowed."""


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one worker.

    ``stage`` is the stage index within ``pipe``; ``microbatch`` is numbered within the pipe. ``count`` > 1
    means one action over micro-batches ``microbatch .. microbatch+count-1`` (forward doubling).
    Send/receive actions name the stage whose output (SEND_ACT, SEND_GRAD) or input (RECV_ACT,
    RECV_GRAD) travels: SEND_ACT(s) pairs with RECV_ACT(s+1), SEND_GRAD(s) with RECV_GRAD(s-1).
    """

    kind: Kind
    pipe: str = DOWN
    stage: int = -1
    microbatch: int = -1
    count: int = 1

    def __init__(self, kind: Kind, pipe: str = DOWN, stage: int = -1, microbatch: int = -1, count: int = 1) -> None:
        # the slots' own setters: a frozen dataclass's generated __init__ goes through object.__setattr__ per
        # field, which made building a large schedule's actions a sizeable part of planning
        _SET_KIND(self, kind)
        _SET_PIPE(self, pipe)
        _SET_STAGE(self, stage)
        _SET_MICROBATCH(self, microbatch)
        _SET_COUNT(self, count)

    @property
    def microbatches(self) -> range:
        return range(self.microbatch, self.microbatch + self.count)

    def text(self, with_pipe: bool = True) -> str:
        """Compact text form, e.g. ``d0F3``; without the pipe prefix for single-direction schedules."""
        spec = SPECS[self.kind]
        if spec.address is Address.NONE:
            return spec.code
        prefix = PIPE_PREFIX[self.pipe] if with_pipe else ""
        if spec.address is Address.STAGE:
            return f"{prefix}{self.stage}{spec.code}"
        mb = str(self.microbatch) if self.count == 1 else f"{self.microbatch}-{self.microbatch + self.count - 1}"
        return f"{prefix}{self.stage}{spec.code}{mb}"

    def __str__(self) -> str:
        return self.text()

    @staticmethod
    def parse(text: str) -> Action:
        """Parse the compact text form; a missing pipe prefix means the down pipe."""
        t = text.strip()
        mb_re, stage_re, none_codes = _patterns()
        if t in none_codes:
            return Action(none_codes[t])
        m = mb_re.match(t)
        if m:
            pre, stage, code, mb, last = m.groups()
            count = 1 if last is None else int(last) - int(mb) + 1
            if count < 1:
                raise ValueError(f"bad micro-batch range in action {text!r}")
            return Action(KIND_OF_CODE[code], PREFIX_PIPE.get(pre, DOWN), int(stage), int(mb), count)
        m = stage_re.match(t)
        if m:
            pre, stage, code = m.groups()
            return Action(KIND_OF_CODE[code], PREFIX_PIPE.get(pre, DOWN), int(stage))
        raise ValueError(
            f"cannot parse action {text!r}: expected e.g. '0F3', 'u2B1', 'd0F2-3', 'd1RECV_F3', 'd0AR_START' or 'OPT'"
        )


_SET_KIND, _SET_PIPE, _SET_STAGE, _SET_MICROBATCH, _SET_COUNT = (
    Action.__dict__[f].__set__ for f in ("kind", "pipe", "stage", "microbatch", "count"))


def F(pipe: str, stage: int, mb: int, count: int = 1) -> Action:
    """Forward of ``stage`` in ``pipe`` on micro-batch ``mb`` (``count`` micro-batches at once)."""
    return Action(Kind.F, pipe, stage, mb, count)


def B(pipe: str, stage: int, mb: int, count: int = 1) -> Action:
    """Backward of ``stage`` in ``pipe`` on micro-batch ``mb``."""
    return Action(Kind.B, pipe, stage, mb, count)


@dataclass(frozen=True)
class Schedule:
    """Placement plus per-worker action lists for one data-parallel group.

    Attributes:
        name: generator name (``gpipe``, ``1f1b``, ``interleaved``, ``chimera``, ...); not part of equality.
        stages: stages per pipe (D, or D*v for interleaved).
        microbatches: micro-batch units per group per iteration (N), split evenly among ``pipes``.
        placement: ``(pipe, stage) -> worker`` within the group.
        actions: one tuple of actions per worker, in execution order.
        data_parallel: W; global rank of group g's worker w is ``g * workers + w``.
        microbatch_scale: samples per micro-batch unit relative to the configured micro-batch size
            (1/2 for Chimera backward halving).
        lowered: whether communication / sync / optimizer actions were added.
    """

    stages: int
    microbatches: int
    placement: Mapping[tuple[str, int], int]
    actions: tuple[tuple[Action, ...], ...]
    data_parallel: int = 1
    microbatch_scale: Fraction = Fraction(1)
    lowered: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", dict(sorted(self.placement.items())))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))

    @property
    def workers(self) -> int:
        return len(self.actions)

    @cached_property
    def pipes(self) -> tuple[str, ...]:
        present = {p for p, _ in self.placement}
        return tuple(p for p in PIPES if p in present)

    @cached_property
    def splits_backward(self) -> bool:
        """Some action is a part of a split backward (an input-gradient or weight-gradient part)."""
        return any(a.kind.spec.part_of is not None for row in self.actions for a in row)

    @property
    def bidirectional(self) -> bool:
        """More than the down pipe: actions carry their pipe's prefix in text form."""
        return self.pipes != (DOWN,)

    def pipe_microbatches(self, pipe: str) -> int:
        """Micro-batch units that travel through ``pipe`` per iteration."""
        return self.microbatches // len(self.pipes)

    def global_microbatch(self, pipe: str, microbatch: int) -> int:
        """Index of a pipe's micro-batch among all N of the iteration (down first, then up)."""
        return self.pipes.index(pipe) * self.pipe_microbatches(pipe) + microbatch

    def stages_of(self, worker: int) -> list[tuple[str, int]]:
        """The (pipe, stage) replicas that ``worker`` holds."""
        return list(self._held.get(worker, ()))

    @cached_property
    def _held(self) -> dict[int, tuple[tuple[str, int], ...]]:
        out: dict[int, list[tuple[str, int]]] = {}
        for ps, w in self.placement.items():
            out.setdefault(w, []).append(ps)
        return {w: tuple(v) for w, v in out.items()}

    @cached_property
    def _replicas(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for _, s in self.placement:
            out[s] = out.get(s, 0) + 1
        return out

    def stage_group_size(self, stage: int) -> int:
        """How many ranks (over all W groups) hold a replica of ``stage``: ``len(stage_group(stage))``."""
        return self._replicas.get(stage, 0) * self.data_parallel

    def stage_group(self, stage: int) -> list[int]:
        """Global ranks (over all W groups) holding a replica of ``stage``: the gradient allreduce group."""
        local = sorted({w for (p, s), w in self.placement.items() if s == stage})
        return [g * self.workers + w for g in range(self.data_parallel) for w in local]

    def compute_only(self) -> Schedule:
        """The same schedule with only F and B actions (itself where it has no other)."""
        if not self.lowered and all(k.is_compute for k in {a.kind for row in self.actions for a in row}):
            return self
        acts = tuple(tuple(a for a in row if a.kind.is_compute) for row in self.actions)
        return _replace(self, actions=acts, lowered=False)

    def with_data_parallel(self, width: int) -> Schedule:
        """Replicate the placement over ``width`` data-parallel groups."""
        if width < 1:
            raise ValueError(f"data-parallel width must be >= 1, got {width}")
        return _replace(self, data_parallel=width)

    def text(self) -> str:
        """Multi-line text form: a header line, then ``worker: actions`` per worker."""
        head = (
            f"# {self.name} stages={self.stages} microbatches={self.microbatches} "
            f"data_parallel={self.data_parallel} scale={self.microbatch_scale} lowered={int(self.lowered)}"
        )
        bi = self.bidirectional
        rows = [f"{w}: " + " ".join(a.text(bi) for a in row) for w, row in enumerate(self.actions)]
        return "\n".join([head, *rows])

    @staticmethod
    def from_text(text: str) -> Schedule:
        """Parse :meth:`text` output (the header line is optional)."""
        meta: dict[str, str] = {}
        name = "custom"
        rows: list[list[Action]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                parts = line[1:].split()
                if parts and "=" not in parts[0]:
                    name = parts.pop(0)
                meta.update(p.split("=", 1) for p in parts if "=" in p)
                continue
            w, _, rest = line.partition(":")
            if not w.strip().isdigit() or int(w) != len(rows):
                raise ValueError(f"expected a line starting with '{len(rows)}:', got {line[:40]!r}")
            rows.append([Action.parse(t) for t in rest.split()])
        return from_rows(
            rows,
            name=name,
            microbatches=int(meta["microbatches"]) if "microbatches" in meta else None,
            stages=int(meta["stages"]) if "stages" in meta else None,
            data_parallel=int(meta.get("data_parallel", 1)),
            microbatch_scale=Fraction(meta.get("scale", "1")),
        )


def _replace(s: Schedule, **kw: object) -> Schedule:
    fields = dict(
        stages=s.stages,
        microbatches=s.microbatches,
        placement=s.placement,
        actions=s.actions,
        data_parallel=s.data_parallel,
        microbatch_scale=s.microbatch_scale,
        lowered=s.lowered,
        name=s.name,
    )
    fields.update(kw)
    return Schedule(**fields)  # type: ignore[arg-type]


def from_rows(
    rows: Sequence[Iterable[Action]],
    *,
    name: str = "custom",
    microbatches: int | None = None,
    stages: int | None = None,
    data_parallel: int = 1,
    microbatch_scale: Fraction = Fraction(1),
) -> Schedule:
    """Build a schedule from per-worker action lists, inferring placement, stages and N from the actions."""
    rows = [list(r) for r in rows]
    placement: dict[tuple[str, int], int] = {}
    max_mb: dict[str, int] = {}
    lowered = False
    for w, row in enumerate(rows):
        for a in row:
            if a.kind.is_compute:
                prev = placement.setdefault((a.pipe, a.stage), w)
                if prev != w:
                    raise ValueError(f"{a.text()} appears on worker {w} but stage is placed on worker {prev}")
                max_mb[a.pipe] = max(max_mb.get(a.pipe, -1), a.microbatch + a.count - 1)
            else:
                lowered = True
    if not placement:
        raise ValueError("schedule has no F or B action")
    n_stages = stages if stages is not None else 1 + max(s for _, s in placement)
    if microbatches is None:
        microbatches = sum(m + 1 for m in max_mb.values())
    return Schedule(
        stages=n_stages,
        microbatches=microbatches,
        placement=placement,
        actions=tuple(tuple(r) for r in rows),
        data_parallel=data_parallel,
        microbatch_scale=microbatch_scale,
        lowered=lowered,
        name=name,
    )

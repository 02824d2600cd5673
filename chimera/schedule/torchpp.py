"""torch.distributed.pipelining's schedule CSV, as its writer (``PipelineScheduleMulti._dump_csv``) produces it.

One row per rank, one cell per action, no header; an empty cell is a step the rank idles. Torch's cells::

    2F0             stage 2, forward, micro-batch 0 (also B: full backward, I: input-gradient, W: weight-gradient)
    2SEND_F0        rank of stage 2 sends its output of micro-batch 0 (RECV_F, SEND_B, RECV_B likewise)
    2UNSHARD        FSDP: gather stage 2's weights (RESHARD: free them; REDUCE_GRAD: reduce its gradients)
    (0F7;7B3)OVERLAP_F_B   DualPipeV: a forward and a backward issued together

What chimera keeps: the compute actions of each row, in order (an ``OVERLAP_F_B`` as its parts, forward first), on
the down pipe, stage s on the rank whose row runs it (interleaved: s mod D; V shapes: s and 2D-1-s on one rank).
What it drops, with a note: the sends and receives, once checked against what chimera's lowering derives from
that placement (:func:`chimera.schedule.lowering.add_p2p`; the naming is the same: a send names the stage whose
output leaves, a receive the stage that needs it), and the FSDP actions, which mean nothing to chimera (it does
not shard weights; it sums gradients itself). Every error names the cell: row (rank), column, text.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from chimera.schedule.ir import DOWN, PIPE_PREFIX, Action, Kind, Schedule, from_rows
from chimera.schedule.kinds import Res, message
from chimera.schedule.lowering import add_p2p

COMPUTE = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}
P2P = {"SEND_F": Kind.SEND_ACT, "RECV_F": Kind.RECV_ACT, "SEND_B": Kind.SEND_GRAD, "RECV_B": Kind.RECV_GRAD}
FSDP = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
OVERLAP = "OVERLAP_F_B"
#: kinds chimera and torch write alike (``0F3``, ``1SEND_F2``): a file of only these reads the same either way
SHARED = frozenset((*COMPUTE.values(), *P2P.values()))
_CELL = re.compile(r"(\d+)([A-Z][A-Z_]*)(\d*)")
_OVERLAP = re.compile(rf"\((.*)\){OVERLAP}")
_KNOWN = ", ".join([*COMPUTE, *P2P, *FSDP, OVERLAP])


@dataclass(frozen=True)
class Cell:
    """Where an action stands in the file: ``row`` is the rank (0-based), ``col`` the 0-based column."""

    row: int
    col: int
    text: str

    def __str__(self) -> str:
        return f"row {self.row + 1} (rank {self.row}), column {self.col + 1} {self.text!r}"


class TorchCsvError(ValueError):
    """A torch CSV chimera cannot take; the message names the cell and what to change."""


@dataclass(frozen=True)
class TorchCsv:
    """A torch CSV read: the compute-only schedule and notes on what was dropped or expanded."""

    schedule: Schedule
    notes: tuple[str, ...]


def _chimera_only(text: str) -> bool:
    """A cell only chimera's own CSV writes: a pipe prefix, a micro-batch range, or a kind torch has not."""
    try:
        a = Action.parse(text)
    except ValueError:
        return False
    return a.kind not in SHARED or a.count != 1 or text[0] in PIPE_PREFIX.values()


def _torch_only(text: str) -> bool:
    m = _CELL.fullmatch(text)
    return bool(_OVERLAP.fullmatch(text) or (m and m.group(2) in FSDP))


def is_torch_csv(rows: Sequence[Sequence[str]]) -> bool:
    """Whether ``rows`` are torch's CSV rather than chimera's (:func:`chimera.schedule.io.to_csv`).

    Torch's writer has no header, so the cells decide: a file with any chimera-only cell (``d0F3``, ``d0F2-3``,
    ``OPT``, ``0AR_START``) is chimera's; any other is read as torch's (a compute-only single-pipe file reads the
    same either way). A file with cells only torch writes and cells only chimera writes is refused."""
    cells = [Cell(r, c, t.strip()) for r, row in enumerate(rows) for c, t in enumerate(row) if t.strip()]
    ours = next((x for x in cells if _chimera_only(x.text)), None)
    theirs = next((x for x in cells if _torch_only(x.text)), None)
    if ours and theirs:
        raise TorchCsvError(f"{ours} is chimera's syntax but {theirs} is torch.distributed.pipelining's: write "
                            "the file in one of them")
    return ours is None


def _one(cell: Cell, text: str, in_overlap: bool) -> tuple[str, Action | None]:
    """One torch action: its code and the action (None for an FSDP action, which is dropped)."""
    m = _CELL.fullmatch(text)
    if not m:
        raise TorchCsvError(f"{cell}: not an action: torch writes [stage][type][micro-batch], e.g. '2F0', '1SEND_B3', "
                            f"'0UNSHARD' or '(0F7;7B3)OVERLAP_F_B' (chimera: '0F3', 'd0F3'); fix the cell")
    stage, code, mb = int(m.group(1)), m.group(2), m.group(3)
    if code not in COMPUTE and code not in P2P and code not in FSDP:
        raise TorchCsvError(f"{cell}: unknown torch action type {code!r} (known: {_KNOWN}); fix the cell")
    if in_overlap and code not in COMPUTE:
        raise TorchCsvError(f"{cell}: {OVERLAP} holds compute actions (F, B, I, W) only, not {code}; fix the cell")
    if code in FSDP:
        if mb:
            raise TorchCsvError(f"{cell}: {code} names a stage, not a micro-batch: write '{stage}{code}'")
        return code, None
    if not mb:
        raise TorchCsvError(f"{cell}: {code} needs a micro-batch index, e.g. '{stage}{code}0'")
    return code, Action(COMPUTE.get(code) or P2P[code], DOWN, stage, int(mb))


def _parse(rows: Sequence[Sequence[str]]) -> tuple[list[list[tuple[Cell, Action]]], list[tuple[Cell, Action]],
                                                   Counter[str]]:
    """Per rank the compute actions with their cells; the sends and receives; a count of what was dropped or
    expanded."""
    compute: list[list[tuple[Cell, Action]]] = []
    p2p: list[tuple[Cell, Action]] = []
    seen: Counter[str] = Counter()
    for r, row in enumerate(rows):
        out: list[tuple[Cell, Action]] = []
        for c, raw in enumerate(row):
            cell = Cell(r, c, raw.strip())
            if not cell.text:
                continue  # torch's idle step
            pair = _OVERLAP.fullmatch(cell.text)
            parts = [p.strip() for p in pair.group(1).split(";") if p.strip()] if pair else [cell.text]
            if pair:
                if not parts:
                    raise TorchCsvError(f"{cell}: an empty {OVERLAP}; give its forward and backward, e.g. "
                                        f"'(0F7;7B3){OVERLAP}'")
                seen[OVERLAP] += 1
            for part in parts:
                code, a = _one(cell, part, bool(pair))
                if a is None:
                    seen[code] += 1
                elif code in P2P:
                    p2p.append((cell, a))
                else:
                    out.append((cell, a))
        compute.append(out)
    return compute, p2p, seen


def _placement(compute: list[list[tuple[Cell, Action]]]) -> tuple[dict[int, int], dict[tuple, Cell]]:
    """Stage -> rank as the rows place them, and the cell of every compute action; one stage on two ranks, a stage
    without actions, or a compute action twice is refused."""
    place: dict[int, tuple[int, Cell]] = {}
    where: dict[tuple, Cell] = {}
    for r, row in enumerate(compute):
        for cell, a in row:
            home = place.setdefault(a.stage, (r, cell))
            if home[0] != r:
                raise TorchCsvError(f"{cell}: stage {a.stage} already runs on rank {home[0]} ({home[1]}); a stage "
                                    f"lives on one rank: move the action to row {home[0] + 1} or fix its stage")
            key = (a.kind, a.stage, a.microbatch)
            if key in where:
                raise TorchCsvError(f"{cell}: {a.text(False)} runs twice (also {where[key]}); remove one")
            where[key] = cell
    if not place:
        raise TorchCsvError("no compute action (F, B, I, W) in any row")
    missing = [s for s in range(max(place) + 1) if s not in place]
    if missing:
        raise TorchCsvError(f"stage {missing[0]} has no action in any row, but the file names stages up to "
                            f"{max(place)}: number the stages 0..{len(place) - 1} without gaps")
    return {s: r for s, (r, _) in place.items()}, where


def _why_extra(a: Action, rank: int, place: dict[int, int], where: dict[tuple, Cell]) -> str:
    """Why chimera's lowering of the placement has no send/receive ``a`` on ``rank``."""
    send = a.kind.is_send
    home = place.get(a.stage)
    if home is None:
        return f"stage {a.stage} has no compute action in any row"
    if home != rank:
        return f"stage {a.stage} runs on rank {home} (row {home + 1}), not on rank {rank}"
    msg, peer = message(a.kind, DOWN, a.stage, a.microbatch)
    if peer not in place:
        end = "last" if peer > a.stage else "first"
        return f"stage {a.stage} is the {end} stage: it has no neighbour to {'send to' if send else 'receive from'}"
    if place[peer] == rank:
        what = "activation" if msg.res is Res.ACT else "gradient"
        return f"stages {a.stage} and {peer} both run on rank {rank}: the {what} is handed over in memory, not sent"
    makers = (Kind.F,) if msg.res is Res.ACT else (Kind.B, Kind.I)
    if not any((k, msg.stage, msg.microbatch) in where for k in makers):
        return f"no row runs the {'forward' if msg.res is Res.ACT else 'backward'} of stage {msg.stage} on " \
               f"micro-batch {msg.microbatch} that would make it"
    return "chimera's lowering of the placement has no such message"  # pragma: no cover - the cases above cover it


def _check_p2p(sched: Schedule, p2p: list[tuple[Cell, Action]], place: dict[int, int],
               where: dict[tuple, Cell]) -> None:
    """Torch's sends and receives, where the file has any, are exactly those :func:`add_p2p` derives from the
    placement (torch sends nothing between two stages of one rank, nor does chimera)."""
    if not p2p:
        return
    ours = {(w, a) for w, row in enumerate(add_p2p(sched).actions) for a in row if a.kind.is_p2p}
    theirs: dict[tuple[int, Action], Cell] = {}
    for cell, a in p2p:
        key = (cell.row, a)
        if key in theirs:
            raise TorchCsvError(f"{cell}: {a.text(False)} appears twice on rank {cell.row} (also {theirs[key]}); "
                                "remove one")
        theirs[key] = cell
        if key not in ours:
            raise TorchCsvError(f"{cell}: this {'send' if a.kind.is_send else 'receive'} disagrees with the placement "
                                f"the compute actions give: {_why_extra(a, cell.row, place, where)}; fix or remove "
                                "the cell (chimera derives its own sends and receives from the placement)")
    for rank, a in sorted(ours - set(theirs), key=lambda k: (k[0], k[1].stage, k[1].microbatch, k[1].kind.value)):
        kinds = (Kind.F,) if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT) else (Kind.B, Kind.I)
        cell = next(where[k] for k in ((x, a.stage, a.microbatch) for x in kinds) if k in where)
        raise TorchCsvError(f"{cell} needs '{a.text(False)}' on rank {rank} (its stage's neighbour runs on another "
                            f"rank), but row {rank + 1} has none: the file's sends and receives disagree with its "
                            "placement; add the cell, or give compute actions only (chimera adds its own)")


def _check_counts(compute: list[list[tuple[Cell, Action]]], stages: int, ranks: int | None,
                  microbatches: int | None) -> int:
    """The file's micro-batch count (those stage 0 runs forward: a stray micro-batch elsewhere is the validator's to
    name), checked against ``ranks`` rows and ``microbatches`` where given."""
    cells = [x for row in compute for x in row]
    firsts = [a.microbatch for _, a in cells if a.stage == 0 and a.kind is Kind.F] or [a.microbatch for _, a in cells]
    n = 1 + max(firsts)
    fix = f"pass --stages {len(compute)} --micro-batches {n}"
    if ranks is not None and len(compute) != ranks:
        raise TorchCsvError(f"the file has {len(compute)} rows, one per rank, but --stages is {ranks}: {fix} "
                            f"(--stages counts the ranks; the model is cut into the file's {stages} stages)")
    for r, row in enumerate(compute):
        if not row:
            raise TorchCsvError(f"row {r + 1} (rank {r}) has no compute action (F, B, I, W): give every rank a stage "
                                "or remove the row")
    if microbatches is not None and n > microbatches:
        cell, a = next((c, a) for c, a in cells if a.microbatch >= microbatches)
        raise TorchCsvError(f"{cell}: micro-batch {a.microbatch} is past --micro-batches {microbatches}: the file runs "
                            f"{n} micro-batches on {len(compute)} ranks; {fix}")
    if microbatches is not None and n < microbatches:
        cell = next(c for c, a in cells if a.microbatch == n - 1 and a.stage == 0)
        raise TorchCsvError(f"{cell} runs the file's last micro-batch, {n - 1}, but --micro-batches is {microbatches}: "
                            f"the file runs {n} micro-batches on {len(compute)} ranks; {fix}")
    return n


def _notes(seen: Counter[str], p2p: int) -> tuple[str, ...]:
    notes = []
    if seen[OVERLAP]:
        notes.append(f"ran each of {seen[OVERLAP]} {OVERLAP} as its forward, then its backward")
    if p2p:
        notes.append(f"dropped {p2p} SEND_F/RECV_F/SEND_B/RECV_B: they agree with the placement, and chimera derives "
                     "its own sends and receives from it")
    fsdp = [f"{seen[k]} {k}" for k in FSDP if seen[k]]
    if fsdp:
        notes.append(f"dropped {', '.join(fsdp)}: FSDP actions, with no meaning for chimera (it does not shard "
                     "weights, and sums gradients itself)")
    return tuple(notes)


def read_torch_csv(rows: Sequence[Sequence[str]], *, name: str = "torch", ranks: int | None = None,
                   microbatches: int | None = None, data_parallel: int = 1,
                   microbatch_scale: Fraction = Fraction(1)) -> TorchCsv:
    """The compute-only schedule of torch's CSV ``rows`` (one per rank), stage s on the rank whose row runs it.

    ``ranks`` / ``microbatches``: what ``--stages`` and ``--micro-batches`` say; the file must agree. Raises
    :class:`TorchCsvError` naming the cell and what to change."""
    rows = [list(r) for r in rows]
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()  # blank lines at the end
    compute, p2p, seen = _parse(rows)
    place, where = _placement(compute)
    n = _check_counts(compute, len(place), ranks, microbatches)
    sched = from_rows([[a for _, a in row] for row in compute], name=name, microbatches=n, stages=len(place),
                      data_parallel=data_parallel, microbatch_scale=microbatch_scale)
    _check_p2p(sched, p2p, place, where)
    return TorchCsv(sched, _notes(seen, len(p2p)))

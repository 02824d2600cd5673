"""The one validator: structural checks plus a deadlock-free run under blocking point-to-point semantics.

Checks, in order:

1. every action sits on the worker that holds its (pipe, stage);
2. every (pipe, stage, micro-batch) has exactly one F and one B (or one I and one W instead of the B), each after
   what it consumes (B and I after F, W after I);
3. (lowered) every send has exactly one matching receive on the right peer, and on every channel
   (sender, receiver, pipe) the sends and the receives come in the same order (NCCL matches p2p
   messages in posting order);
4. the lists run to completion with :class:`chimera.schedule.replay.Replay` (a compute-only schedule is
   lowered first): blocking receives, non-blocking sends, allreduce waits that need every replica.

A failure raises :class:`ScheduleError`, whose message holds the step x worker grid with the offending
actions marked ``>...<``.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from chimera.schedule.ir import Action, Kind, Schedule
from chimera.schedule.kinds import PARTS, SPECS, Address
from chimera.schedule.lowering import lower
from chimera.schedule.replay import Replay, message_key


class ScheduleError(ValueError):
    """A schedule is invalid; the message explains why and shows the step x worker grid."""


def format_grid(
    schedule: Schedule, marks: dict[int, int] | None = None, window: int = 12, max_rows: int = 48
) -> str:
    """Render the lists as a step x worker table; ``marks`` maps worker -> step to highlight."""
    marks = marks or {}
    bi = schedule.bidirectional
    rows = schedule.actions
    height = max((len(r) for r in rows), default=0)
    lo, hi = 0, height
    if height > max_rows and marks:
        lo = max(0, min(marks.values()) - window)
        hi = min(height, max(marks.values()) + window + 1)
    elif height > max_rows:
        hi = max_rows

    def cell(w: int, i: int) -> str:
        if i >= len(rows[w]):
            return ""
        t = rows[w][i].text(bi)
        return f">{t}<" if marks.get(w) == i else t

    width = max([8, *(len(cell(w, i)) for w in range(len(rows)) for i in range(lo, hi))]) + 1
    lines = ["step " + "".join(f"w{w}".ljust(width) for w in range(len(rows)))]
    if lo > 0:
        lines.append(f"... ({lo} steps above)")
    for i in range(lo, hi):
        lines.append(f"{i:<5}" + "".join(cell(w, i).ljust(width) for w in range(len(rows))))
    if hi < height:
        lines.append(f"... ({height - hi} steps below)")
    return "\n".join(line.rstrip() for line in lines)


def _fail(schedule: Schedule, msg: str, marks: dict[int, int]) -> None:
    raise ScheduleError(f"invalid {schedule.name} schedule: {msg}\n{format_grid(schedule, marks)}")


def _check_structure(s: Schedule) -> None:
    once = [k for k, spec in SPECS.items() if spec.once]
    counts: Counter[tuple[Kind, str, int, int]] = Counter()
    first: dict[tuple[Kind, str, int, int], tuple[int, int]] = {}
    for w, row in enumerate(s.actions):
        for i, a in enumerate(row):
            if SPECS[a.kind].address is Address.NONE:
                continue
            home = s.placement.get((a.pipe, a.stage))
            if home is None:
                _fail(s, f"{a} names stage {a.stage} of the {a.pipe} pipe, which no worker holds", {w: i})
            if home != w:
                _fail(s, f"{a} is on worker {w} but stage {a.stage} of the {a.pipe} pipe is on worker {home}", {w: i})
            if SPECS[a.kind].once:
                for m in a.microbatches:
                    key = (a.kind, a.pipe, a.stage, m)
                    counts[key] += 1
                    first.setdefault(key, (w, i))
    made = {res: kind for kind in once for res in SPECS[kind].produces}
    # (consumer, maker): a kind that consumes what another kind makes on its own stage comes after it
    ordered = [(kind, made[use.res]) for kind in once for use in SPECS[kind].consumes
               if use.offset == 0 and use.res in made]
    for (p, st), w in s.placement.items():
        for m in range(s.pipe_microbatches(p)):
            for kind in once:
                if SPECS[kind].part_of is None:
                    _check_once(s, kind, (p, st, m), w, counts, first)
            for kind, maker in ordered:
                if (kind, p, st, m) not in first:
                    continue  # the other alternative (a whole B, or its parts I and W) ran
                at = first[(kind, p, st, m)][1]
                if first[(maker, p, st, m)][1] > at:
                    _fail(s, f"{Action(kind, p, st, m)} comes before its {SPECS[maker].name} on worker {w}", {w: at})
    extra = [k for k in counts if k[3] >= s.pipe_microbatches(k[1])]
    if extra:
        k = extra[0]
        _fail(s, f"{Action(k[0], k[1], k[2], k[3])}: micro-batch {k[3]} is out of range for "
              f"{s.pipe_microbatches(k[1])} micro-batches in the {k[1]} pipe", {first[k][0]: first[k][1]})


def _check_once(s: Schedule, kind: Kind, where: tuple[str, int, int], w: int,
                counts: Counter[tuple[Kind, str, int, int]], first: dict[tuple[Kind, str, int, int], tuple[int, int]]
                ) -> None:
    """``kind`` runs once for the micro-batch, or (where it has parts) each of its parts does instead."""
    p, st, m = where
    n = counts[(kind, *where)]
    parts = PARTS.get(kind, ())
    got = [counts[(part, *where)] for part in parts]
    if (n == 1 and not any(got)) or (parts and n == 0 and all(g == 1 for g in got)):
        return
    keys = [k for k in ((kind, *where), *((part, *where) for part in parts)) if k in first]
    marks = {first[keys[0]][0]: first[keys[0]][1]} if keys else {}
    what = f"{Action(kind, p, st, m)} ({kind.value} of micro-batch {m}) appears {n} times"
    if not parts:
        _fail(s, f"{what}, expected once on worker {w}", marks)
    names = " and ".join(f"one {part.value}" for part in parts)
    found = ", ".join(f"{part.value} {g} times" for part, g in zip(parts, got))
    _fail(s, f"{what} and its parts {found}: expected on worker {w} either one {kind.value} or {names}", marks)


def _check_channels(s: Schedule) -> None:
    sends: dict[tuple[int, int, str], list[tuple[tuple, int]]] = defaultdict(list)
    recvs: dict[tuple[int, int, str], list[tuple[tuple, int]]] = defaultdict(list)
    place = dict(s.placement)
    for w, row in enumerate(s.actions):
        for i, a in enumerate(row):
            if not a.kind.is_p2p:
                continue
            try:
                key, peer = message_key(a, place)
            except KeyError:
                _fail(s, f"{a} has no peer stage (it is at the end of the {a.pipe} pipe)", {w: i})
            if a.kind.is_send:
                sends[(w, peer, a.pipe)].append(((key, a.count), i))
            else:
                recvs[(peer, w, a.pipe)].append(((key, a.count), i))
    for ch in sorted(set(sends) | set(recvs)):
        src, dst, pipe = ch
        ss, rr = sends.get(ch, []), recvs.get(ch, [])
        for n, (x, y) in enumerate(zip(ss, rr)):
            if x[0] != y[0]:
                _fail(s, f"worker {src} sends {x[0][0]} as message {n} of the {pipe} channel to worker {dst}, "
                      f"but worker {dst} receives {y[0][0]} there (messages match in order)", {src: x[1], dst: y[1]})
        if len(ss) != len(rr):
            longer, w = (ss, src) if len(ss) > len(rr) else (rr, dst)
            extra = longer[min(len(ss), len(rr))]
            _fail(s, f"unmatched {'send' if longer is ss else 'receive'} {extra[0][0]} on the {pipe} channel "
                  f"{src}->{dst}", {w: extra[1]})


def validate(schedule: Schedule) -> Schedule:
    """Check ``schedule``; return it unchanged when valid, else raise :class:`ScheduleError`."""
    _check_structure(schedule)
    run = schedule
    if schedule.lowered:
        _check_channels(schedule)
    else:
        run = lower(schedule)
        _check_channels(run)
    stuck = Replay(run).stuck
    if stuck:
        marks = {w: i for w, (i, _) in stuck.items()}
        why = "; ".join(f"worker {w} at step {i}: {r}" for w, (i, r) in sorted(stuck.items()))
        prefix = "" if run is schedule else "(after lowering) "
        raise ScheduleError(f"invalid {schedule.name} schedule: {prefix}deadlock: {why}\n{format_grid(run, marks)}")
    return schedule

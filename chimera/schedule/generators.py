"""Schedule generators: compute-only action lists for GPipe, 1F1B, interleaved 1F1B and Chimera (the schedules
ordered by the zero-bubble list scheduler, with split backward, are in :mod:`chimera.schedule.listed`).

Every generator returns a :class:`~chimera.schedule.ir.Schedule` whose lists hold only compute actions (F and B,
or I and W);
:func:`chimera.schedule.lowering.lower` adds communication and gradient synchronisation.

Usage::

    >>> from chimera.schedule import build_schedule
    >>> s = build_schedule("1f1b", stages=4, microbatches=8)
    >>> [a.text(False) for a in s.actions[3]][:4]
    ['3F0', '3B0', '3F1', '3B1']
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from chimera.schedule.fill import EQUAL, chimera_split
from chimera.schedule.ir import (
    DOWN,
    UP,
    Action,
    B,
    F,
    Schedule,
    ScheduleConfigError,
    _replace,
)
from chimera.schedule.registry import ScheduleSpec, cached_build, register
from chimera.schedule.simulate import Costs


def _check_common(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ScheduleConfigError(f"--stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ScheduleConfigError(f"--micro-batches must be >= 1, got {microbatches}")


def _single(name: str, stages: int, n: int, rows: list[list[Action]]) -> Schedule:
    placement = {(DOWN, s): s for s in range(stages)}
    return Schedule(stages=stages, microbatches=n, placement=placement, actions=rows, name=name)


def _unordered(name: str) -> Any:
    """The frame (``ScheduleSpec.frame``) of a one-pipe schedule of D stages: stage s on worker s."""

    def frame(stages: int, microbatches: int, **options: Any) -> Schedule:
        _check_common(stages, microbatches)
        return _single(name, stages, microbatches, [[] for _ in range(stages)])

    return frame


def gpipe(stages: int, microbatches: int, reverse_backward: bool = False) -> Schedule:
    """GPipe: every worker runs all N forwards, then all N backwards (in reverse order if asked)."""
    _check_common(stages, microbatches)
    order = range(microbatches - 1, -1, -1) if reverse_backward else range(microbatches)
    rows = [
        [F(DOWN, s, m) for m in range(microbatches)] + [B(DOWN, s, m) for m in order] for s in range(stages)
    ]
    return _single("gpipe", stages, microbatches, rows)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush / DAPPLE): min(D-1-s, N) warm-up forwards, alternate F and B, drain the Bs."""
    _check_common(stages, microbatches)
    rows = []
    for s in range(stages):
        warm = min(stages - 1 - s, microbatches)
        row = [F(DOWN, s, m) for m in range(warm)]
        f, b = warm, 0
        while f < microbatches:
            row += [F(DOWN, s, f), B(DOWN, s, b)]
            f, b = f + 1, b + 1
        row += [B(DOWN, s, m) for m in range(b, microbatches)]
        rows.append(row)
    return _single("1f1b", stages, microbatches, rows)


def interleaved_1f1b(stages: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, as in torch's ``ScheduleInterleaved1F1B``).

    ``stages`` is the number of workers D; each worker holds ``chunks`` = v model chunks, so the pipe has
    D*v stages and stage ``c*D + w`` lives on worker w. Micro-batches go through chunks in groups of D.
    Worker w runs ``2*(D-1-w) + (v-1)*D`` warm-up forwards (capped at N*v), then alternates, then drains.
    """
    _check_common(stages, microbatches)
    if chunks < 1:
        raise ScheduleConfigError(f"--chunks (v, stages per worker) must be >= 1, got {chunks}")
    why = _interleaved_accepts(stages, microbatches, {})
    if why:
        raise ScheduleConfigError(why)
    d, v, n = stages, chunks, microbatches
    total = n * v

    def fwd(k: int, w: int) -> Action:
        c = (k // d) % v
        return F(DOWN, c * d + w, (k // (d * v)) * d + k % d)

    def bwd(k: int, w: int) -> Action:
        c = v - 1 - (k // d) % v
        return B(DOWN, c * d + w, (k // (d * v)) * d + k % d)

    rows = []
    for w in range(d):
        warm = min(total, 2 * (d - 1 - w) + (v - 1) * d) if v > 1 else min(total, d - 1 - w)
        row = [fwd(k, w) for k in range(warm)]
        fk, bk = warm, 0
        while fk < total:
            row += [fwd(fk, w), bwd(bk, w)]
            fk, bk = fk + 1, bk + 1
        row += [bwd(k, w) for k in range(bk, total)]
        rows.append(row)
    return Schedule(stages=d * v, microbatches=n, placement=_interleaved_placement(d, v), actions=rows,
                    name="interleaved")


def _interleaved_placement(d: int, v: int) -> dict[tuple[str, int], int]:
    return {(DOWN, c * d + w): w for c in range(v) for w in range(d)}


def _interleaved_frame(stages: int, microbatches: int, chunks: int = 2) -> Schedule:
    _check_common(stages, microbatches)
    if chunks < 1:
        raise ScheduleConfigError(f"--chunks (v, stages per worker) must be >= 1, got {chunks}")
    return Schedule(stages=stages * chunks, microbatches=microbatches,
                    placement=_interleaved_placement(stages, chunks), actions=[[] for _ in range(stages)],
                    name="interleaved")


def _chimera_rows(d: int, units: int, group: int) -> list[list[Action]]:
    """Chimera basic units (phases P1..P5 of :func:`chimera`) concatenated directly.

    ``group`` micro-batches share one forward slot (one F action with count=group) and the slot's
    backward work is ``group`` single-micro-batch B actions back to back. Between units k and k+1, the
    last phase of unit k (a x B(p)) and the first phase of unit k+1 (a x F(p)) interleave as
    a x [B(p) of unit k, F(p) of unit k+1].
    """
    rows = []
    for w in range(d):
        p, j = (DOWN, w) if w < d // 2 else (UP, d - 1 - w)
        q = UP if p == DOWN else DOWN
        stage = {DOWN: w, UP: d - 1 - w}
        a, b = d // 2 - j, j
        nf = {DOWN: 0, UP: 0}
        nb = {DOWN: 0, UP: 0}
        row: list[Action] = []

        def fs(pipe: str, row: list[Action] = row, nf: dict = nf, stage: dict = stage) -> None:
            row.append(F(pipe, stage[pipe], nf[pipe], group))
            nf[pipe] += group

        def bs(pipe: str, row: list[Action] = row, nb: dict = nb, stage: dict = stage) -> None:
            for _ in range(group):
                row.append(B(pipe, stage[pipe], nb[pipe]))
                nb[pipe] += 1

        for u in range(units):
            for _ in range(a):  # P1 (merged with the previous unit's P5 after the first unit)
                if u > 0:
                    bs(p)
                fs(p)
            for _ in range(b):  # P2
                fs(q)
                fs(p)
            for _ in range(a):  # P3
                fs(q)
                bs(q)
            for _ in range(b):  # P4
                bs(p)
                bs(q)
        for _ in range(a):  # P5 of the last unit
            bs(p)
        rows.append(row)
    return rows


CHIMERA_MODES = ("direct", "doubling", "halving")


def chimera_accepts(stages: int, microbatches: int, options: dict[str, Any]) -> str | None:
    """Why Chimera cannot be built for (D, N) in ``options["mode"]``, or None."""
    mode = options.get("mode", "direct")
    if stages % 2:
        return f"chimera needs an even number of --stages (D), got {stages}"
    if mode not in CHIMERA_MODES:
        return f"unknown chimera mode {mode!r}; allowed: {', '.join(CHIMERA_MODES)}"
    if microbatches % stages:
        return f"chimera needs --micro-batches (N) to be a multiple of --stages (D={stages}); got N={microbatches}"
    if mode == "doubling" and (microbatches // stages) % 2:
        return (f"chimera --mode doubling needs --micro-batches (N) to be a multiple of 2*D={2 * stages}; got "
                f"N={microbatches}: use --micro-batches {2 * stages * max(1, -(-microbatches // (2 * stages)))} or "
                "--mode direct")
    return None


def chimera(stages: int, microbatches: int, mode: str = "direct", split_backward: bool = False,
            order_costs: Costs = EQUAL) -> Schedule:
    """Chimera bidirectional pipelines (Li & Hoefler, SC'21).

    Worker w holds stage w of the down pipe and stage D-1-w of the up pipe; N/2 micro-batches go each way.

    Basic unit (N = D, D even): for worker w let p be the pipe in which w sits in the first half (down if
    w < D/2, with j = w; else up, with j = D-1-w) and q the other pipe; with a = D/2 - j and b = j its order is
    P1: a x F(p), P2: b x [F(q), F(p)], P3: a x [F(q), B(q)], P4: b x [B(p), B(q)], P5: a x B(p), micro-batches
    of one pipe in order. D = 4, worker 0: ``F(d,0) F(d,1) F(u,0) B(u,0) F(u,1) B(u,1) B(d,0) B(d,1)``.

    Modes for N = K*D (the paper's section 3.5; docs/ARCHITECTURE.md):
      * ``direct``: K basic units concatenated, unit k+1's first phase interleaved with unit k's last.
      * ``doubling`` (forward doubling): K/2 units in which every forward slot runs two micro-batches in
        one action (count=2) and the slot's backward runs them one after the other; activation memory per
        forward slot doubles, so pair it with recomputation. Needs K even.
      * ``halving`` (backward halving), as defined here: forward doubling over half-size micro-batches.
        Each of the N micro-batches is split into two halves (2N units of B/2 samples,
        ``microbatch_scale`` = 1/2); a forward slot runs one whole micro-batch (both halves, count=2) and
        each backward action processes one half. Forward memory per slot stays that of one micro-batch,
        the backward work per action is halved. Needs N a multiple of D.
    """
    _check_common(stages, microbatches)
    why = chimera_accepts(stages, microbatches, {"mode": mode})
    if why:
        raise ScheduleConfigError(why)
    if mode == "halving":  # the order of doubling over the 2N halves (split: every action on one half, forwards
        # too, so direct's), on units of half the samples; shared with that build (the planner prices both)
        whole = cached_build("chimera", stages, 2 * microbatches, mode="direct" if split_backward else "doubling",
                             split_backward=split_backward, order_costs=order_costs)
        return _replace(whole, microbatch_scale=Fraction(1, 2))
    k = microbatches // stages
    rows = _chimera_rows(stages, k, 1) if mode == "direct" else _chimera_rows(stages, k // 2, 2)
    s = _replace(_chimera_frame(stages, microbatches, mode), actions=rows)
    return chimera_split(s, order_costs) if split_backward else s


def _chimera_frame(stages: int, microbatches: int, mode: str = "direct", split_backward: bool = False,
                   order_costs: Costs = EQUAL) -> Schedule:
    """Chimera's placement, units (2N halves under halving) and scale; no actions (``ScheduleSpec.frame``)."""
    _check_common(stages, microbatches)
    why = chimera_accepts(stages, microbatches, {"mode": mode})
    if why:
        raise ScheduleConfigError(why)
    placement = {(DOWN, s): s for s in range(stages)}
    placement.update({(UP, s): stages - 1 - s for s in range(stages)})
    halving = mode == "halving"
    return Schedule(stages=stages, microbatches=2 * microbatches if halving else microbatches, placement=placement,
                    actions=[[] for _ in range(stages)], microbatch_scale=Fraction(1, 2) if halving else Fraction(1),
                    name="chimera")


def _interleaved_accepts(stages: int, microbatches: int, options: dict[str, Any]) -> str | None:
    if microbatches % stages:
        return f"interleaved 1F1B needs --micro-batches to be a multiple of --stages ({stages}); got {microbatches}"
    return None


register(ScheduleSpec("gpipe", gpipe, "GPipe: all forwards, then all backwards", backward=(False,), auto=False,
                      takes=("reverse_backward",), frame=_unordered("gpipe")))
register(ScheduleSpec("1f1b", one_f_one_b, "1F1B (PipeDream-flush): warm-up forwards, then one forward, one "
                      "backward", frame=_unordered("1f1b")))
register(ScheduleSpec("interleaved", interleaved_1f1b, "interleaved 1F1B: --chunks stages per worker",
                      aliases=("interleaved1f1b",), accepts=_interleaved_accepts, chunks="option", takes=("chunks",),
                      frame=_interleaved_frame))
register(ScheduleSpec("chimera", chimera, "Chimera: bidirectional pipelines, two stages per worker",
                      accepts=chimera_accepts, modes=CHIMERA_MODES, shares=2,
                      takes=("mode", "split_backward", "order_costs"), frame=_chimera_frame))

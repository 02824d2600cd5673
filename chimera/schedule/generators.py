"""Schedule generators: compute-only action lists for GPipe, 1F1B, interleaved 1F1B, Chimera and the zero-bubble
schedules ZB-H1 and ZB-H2 and the bidirectional V-shaped BitPipe-style schedule (split backward).

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

from chimera.schedule.fill import EQUAL, chimera_split, list_schedule, zero_bubble
from chimera.schedule.ir import (
    DOWN,
    DOWN2,
    UP,
    UP2,
    Action,
    B,
    F,
    Kind,
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


def zb_h1(stages: int, microbatches: int, order_costs: Costs = EQUAL) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24): 1F1B with split backward, W in its bubbles.

    Stage s starts at most D - s forwards ahead of its input-gradient backwards (1F1B's warm-up), and every worker
    holds at most D micro-batches (forwarded, not yet through W): 1F1B's peak, which its first stage reaches,
    so later stages use their spare memory to defer W into the cool-down.
    """
    _check_common(stages, microbatches)
    caps = [min(microbatches, stages - s) for s in range(stages)]
    defer = [min(microbatches, stages)] * stages
    return zero_bubble(one_f_one_b(stages, microbatches), caps, defer, False, "zb-h1", order_costs)


def zb_h2(stages: int, microbatches: int, order_costs: Costs = EQUAL) -> Schedule:
    """ZB-H2: stage s starts up to 2(D - s) - 1 forwards ahead, so forwards fill the warm-up as well; every worker
    holds at most 2D - 1 micro-batches (about twice 1F1B's activation memory)."""
    _check_common(stages, microbatches)
    caps = [min(microbatches, 2 * (stages - s) - 1) for s in range(stages)]
    held = [min(microbatches, 2 * stages - 1)] * stages
    return zero_bubble(one_f_one_b(stages, microbatches), caps, held, False, "zb-h2", order_costs)


def _list_ordered(name: str, microbatches: int, placement: dict[tuple[str, int], int], order_costs: Costs,
                  limits: tuple[int | None, ...]) -> Schedule:
    """Every stage of ``placement`` forwards and input-gradient backwards its pipe's share of the micro-batches,
    in the zero-bubble list scheduler's order (:mod:`chimera.schedule.fill`): each worker prefers earlier
    micro-batches, an I before an F, and fills waits with W, holding at most the first of ``limits`` (micro-batches
    per worker; None: no limit) it finds an order within."""
    pipes = {p for p, _ in placement}
    workers, stages = max(placement.values()) + 1, len(placement) // len(pipes)
    seqs: list[list[Action]] = [[] for _ in range(workers)]
    for (pipe, s), w in placement.items():
        for m in range(microbatches // len(pipes)):
            seqs[w] += [F(pipe, s, m), Action(Kind.I, pipe, s, m)]
    for row in seqs:  # earlier micro-batches first; forwards of a micro-batch before its backwards, by depth
        row.sort(key=lambda a: (a.microbatch, a.kind is Kind.I, a.stage if a.kind is Kind.F else -a.stage, a.pipe))
    for held in limits:
        try:
            rows = list_schedule(stages, placement, seqs, None, None if held is None else [held] * workers,
                                 costs=order_costs)
            break
        except ScheduleConfigError:
            continue
    else:  # pragma: no cover - without a memory limit the list scheduler has always found an order
        raise ScheduleConfigError(f"{name}: no order found for D={workers}, N={microbatches}")
    return Schedule(stages=stages, microbatches=microbatches, placement=placement, actions=rows, name=name)


def bitpipe(stages: int, microbatches: int, order_costs: Costs = EQUAL) -> Schedule:
    """Bidirectional V-shaped pipelines with split backward (BitPipe-style, v = 2).

    The model is split into 2D stages. The down pipe runs down the workers and back up (a V: stage s on worker s
    for s < D, else on worker 2D-1-s), the up pipe the mirror image (stage s on worker D-1-s, else s-D), so
    every worker holds four half-size stages: two of each pipe, and both replicas of two stages meet on it in
    neither pipe's order. N/2 micro-batches go each way, ordered by the zero-bubble list scheduler, each worker
    holding at most 3D half-stage micro-batches (1.5 D micro-batches of activations; more where it finds no
    order within that, as at D = 16, N >= 3D).
    """
    _check_common(stages, microbatches)
    why = _even_microbatches(stages, microbatches, {})
    if why:
        raise ScheduleConfigError(why)
    d = stages
    return _list_ordered("bitpipe", microbatches, _bitpipe_placement(d), order_costs,
                         (3 * d, 4 * d, 6 * d, 8 * d, None))


def _bitpipe_placement(d: int) -> dict[tuple[str, int], int]:
    parts = 2 * d
    placement = {(DOWN, s): s if s < d else parts - 1 - s for s in range(parts)}
    placement.update({(UP, s): d - 1 - s if s < d else s - d for s in range(parts)})
    return placement


def chimera4(stages: int, microbatches: int, order_costs: Costs = EQUAL) -> Schedule:
    """Chimera with four pipelines (the paper's generalisation beyond two), split backward.

    Besides Chimera's down pipe (stage s on worker s) and up pipe (worker D-1-s), a second down and a second up
    pipe run shifted by D/2 workers, so four workers start a pipeline at once instead of two and the start-up
    bubble halves. Every worker holds four stages (two stage pairs, 4/D of the model: the price is weight memory
    and a four-way gradient sum per stage); N/4 micro-batches go through each pipe, ordered by the zero-bubble
    list scheduler, each worker holding at most D micro-batches of activations (1F1B's peak; more only where no
    order fits within it).
    """
    _check_common(stages, microbatches)
    why = _four_pipes(stages, microbatches, {})
    if why:
        raise ScheduleConfigError(why)
    d = stages
    return _list_ordered("chimera4", microbatches, _chimera4_placement(d), order_costs, (d, 2 * d, 4 * d, None))


def _chimera4_placement(d: int) -> dict[tuple[str, int], int]:
    h = d // 2
    placement: dict[tuple[str, int], int] = {}
    for s in range(d):
        placement.update({(DOWN, s): s, (UP, s): d - 1 - s, (DOWN2, s): (s + h) % d, (UP2, s): (d - 1 - s + h) % d})
    return placement


def _list_frame(name: str, placement: Any, accepts: Any) -> Any:
    """The frame (``ScheduleSpec.frame``) of a list-ordered schedule: its placement for D, N micro-batches."""

    def frame(stages: int, microbatches: int, order_costs: Costs = EQUAL) -> Schedule:
        _check_common(stages, microbatches)
        why = accepts(stages, microbatches, {})
        if why:
            raise ScheduleConfigError(why)
        place = placement(stages)
        return Schedule(stages=len(place) // len({p for p, _ in place}), microbatches=microbatches,
                        placement=place, actions=[[] for _ in range(stages)], name=name)

    return frame


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


def _even_microbatches(stages: int, microbatches: int, options: dict[str, Any]) -> str | None:
    if microbatches % 2:
        return f"bitpipe sends half the micro-batches each way: --micro-batches must be even, got {microbatches}"
    return None


def _four_pipes(stages: int, microbatches: int, options: dict[str, Any]) -> str | None:
    if stages % 4 or microbatches % 4:
        return (f"chimera4 runs four pipelines shifted by D/2: --stages and --micro-batches must be multiples of 4, "
                f"got D={stages}, N={microbatches}")
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
register(ScheduleSpec("zb-h1", zb_h1, "ZB-H1: 1F1B with split backward, weight gradients in its bubbles",
                      backward=(True,), takes=("order_costs",), frame=_unordered("zb-h1")))
register(ScheduleSpec("zb-h2", zb_h2, "ZB-H2: forwards fill the warm-up too (about 2x 1F1B's activations)",
                      backward=(True,), takes=("order_costs",), frame=_unordered("zb-h2")))
register(ScheduleSpec("bitpipe", bitpipe, "BitPipe-style: two V-shaped pipelines of 2D half stages",
                      accepts=_even_microbatches, backward=(True,), chunks=2, shares=2,
                      takes=("order_costs",), frame=_list_frame("bitpipe", _bitpipe_placement, _even_microbatches)))
register(ScheduleSpec("chimera4", chimera4, "Chimera with four pipelines (4/D of the model per worker)",
                      accepts=_four_pipes, backward=(True,), shares=4, takes=("order_costs",),
                      frame=_list_frame("chimera4", _chimera4_placement, _four_pipes)))

"""Schedules with split backward (I and W) whose order the zero-bubble list scheduler (:mod:`chimera.schedule.fill`)
makes: ZB-H1, ZB-H2 and ZB-V (one pipe), the bidirectional V-shaped BitPipe-style schedule and four-pipe Chimera.

Registered after the schedules of :mod:`chimera.schedule.generators` (the registry's order is the order in which
``auto`` and the planner enumerate candidates, and so breaks their ties).
"""

from __future__ import annotations

from typing import Any

from chimera.schedule.fill import EQUAL, list_schedule, zero_bubble
from chimera.schedule.generators import (
    _check_common,
    _chimera_frame,
    _unordered,
    chimera,
    chimera_accepts,
    one_f_one_b,
)
from chimera.schedule.ir import DOWN, DOWN2, UP, UP2, Action, F, Kind, Schedule, ScheduleConfigError, _replace
from chimera.schedule.registry import ScheduleSpec, register
from chimera.schedule.simulate import Costs
from chimera.schedule.steps import deferred


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


def zb_v(stages: int, microbatches: int, order_costs: Costs = EQUAL) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory"): one pipe of 2D half-size stages in a V,
    stage s on worker s for s < D, else on worker 2D-1-s, split backward.

    A worker holds two half stages (1/D of the model, as 1F1B) and at most 2D half-stage micro-batches of
    activations (forwarded, not yet through W): 1F1B's peak of D micro-batches. Its forwards and
    input-gradient backwards follow the V's order (:func:`_v_order`); the list scheduler puts each W where the
    worker would otherwise wait or where the memory limit needs it. At F = I = W one flushed step takes
    3N + (D-1)/2 units, against 1F1B's 3(N + D - 1) and ZB-H1's about 3N + D.
    """
    _check_common(stages, microbatches)
    d = stages
    place = _v_placement(d)
    seqs = [_v_order(d, microbatches, w) for w in range(d)]
    rows = list_schedule(2 * d, place, seqs, None, [2 * d] * d, True, order_costs, fifo=False)
    return Schedule(stages=2 * d, microbatches=microbatches, placement=place, actions=rows, name="zb-v")


def _v_placement(d: int) -> dict[tuple[str, int], int]:
    return {(DOWN, s): s if s < d else 2 * d - 1 - s for s in range(2 * d)}


def _v_order(d: int, n: int, w: int) -> list[Action]:
    """Worker ``w``'s forwards and input-gradient backwards of its two stages (``w`` going down, 2D-1-w coming
    back up): 2(D-w)-1 first-leg forwards fill the pipe, then w pairs (second leg, first leg) and D-w second-leg
    forward-backward pairs, then the steady round (first-leg F and I, second-leg F and I), then the remaining
    backwards alternately. Laid out for max(N, 2D-1) micro-batches (the warm-up's length), the ones past N left
    out."""
    legs = (w, 2 * d - 1 - w)
    count = {(k, leg): 0 for k in (Kind.F, Kind.I) for leg in (0, 1)}
    full = max(n, 2 * d - 1)
    out: list[Action] = []

    def emit(kind: Kind, leg: int) -> None:
        m = count[(kind, leg)]
        count[(kind, leg)] = m + 1
        if m < n:
            out.append(Action(kind, DOWN, legs[leg], m))

    for _ in range(2 * (d - w) - 1):
        emit(Kind.F, 0)
    for _ in range(w):
        emit(Kind.F, 1)
        emit(Kind.F, 0)
    for _ in range(d - w):
        emit(Kind.F, 1)
        emit(Kind.I, 1)
    while count[(Kind.F, 1)] < count[(Kind.F, 0)] or count[(Kind.F, 0)] < full:
        if count[(Kind.F, 0)] < full:
            emit(Kind.F, 0)
        emit(Kind.I, 0)
        emit(Kind.F, 1)
        emit(Kind.I, 1)
    while count[(Kind.I, 0)] < full or count[(Kind.I, 1)] < full:
        for leg in (0, 1):
            if count[(Kind.I, leg)] < full:
                emit(Kind.I, leg)
    return out


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


def chimera_relisted(stages: int, microbatches: int, order_costs: Costs = EQUAL) -> Schedule:
    """Chimera (two pipes, 2/D of the model per worker) with backward halving's units and split backward, its
    forwards and input-gradient backwards in the order the list scheduler finds free of Chimera's own sequence and
    activation cap (each worker takes the next forward or backward of any of its stages that can run, an input
    gradient first, and its oldest W wherever it would wait).

    One step is no shorter than Chimera's own split order, but consecutive steps overlap better: where a worker's
    step may start as soon as its stages' gradients are summed (no global norm between steps: no clipping), at
    F = I = W and N = D its steps repeat every 3N units, the least its work allows (Chimera's own halving order:
    3N + D/4 - 1/2; relisted from whole micro-batches it gains nothing at N = D). Its price: up to N micro-batches
    of activations per worker where Chimera's own order holds D/2 (bench/RESULTS.md, the period table). Built only
    when named (``auto`` and the planner rank one step's makespan); ``schedule best --rank-by period`` ranks it
    (its jointly ordered steps are ``chimera --mode halving --split-backward +joint steps``).
    """
    base = chimera(stages, microbatches, "halving", split_backward=True, order_costs=order_costs)
    return _replace(deferred(base, 1, order_costs), name="chimera-relisted")  # one step of the joint order


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


def _even_microbatches(stages: int, microbatches: int, options: dict[str, Any]) -> str | None:
    if microbatches % 2:
        return f"bitpipe sends half the micro-batches each way: --micro-batches must be even, got {microbatches}"
    return None


def _four_pipes(stages: int, microbatches: int, options: dict[str, Any]) -> str | None:
    if stages % 4 or microbatches % 4:
        return (f"chimera4 runs four pipelines shifted by D/2: --stages and --micro-batches must be multiples of 4, "
                f"got D={stages}, N={microbatches}")
    return None


register(ScheduleSpec("zb-h1", zb_h1, "ZB-H1: 1F1B with split backward, weight gradients in its bubbles",
                      backward=(True,), takes=("order_costs",), frame=_unordered("zb-h1")))
register(ScheduleSpec("zb-h2", zb_h2, "ZB-H2: forwards fill the warm-up too (about 2x 1F1B's activations)",
                      backward=(True,), takes=("order_costs",), frame=_unordered("zb-h2")))
register(ScheduleSpec("zb-v", zb_v, "ZB-V: one V of 2D half stages, split backward, 1F1B's memory",
                      backward=(True,), chunks=2, takes=("order_costs",),
                      frame=_list_frame("zb-v", _v_placement, lambda d, n, o: None)))
register(ScheduleSpec("bitpipe", bitpipe, "BitPipe-style: two V-shaped pipelines of 2D half stages",
                      accepts=_even_microbatches, backward=(True,), chunks=2, shares=2,
                      takes=("order_costs",), frame=_list_frame("bitpipe", _bitpipe_placement, _even_microbatches)))
register(ScheduleSpec("chimera-relisted", chimera_relisted,
                      "Chimera, split backward, in the list scheduler's free order (shortest period of steps)",
                      accepts=lambda d, n, o: chimera_accepts(d, n, {"mode": "halving"}), backward=(True,), shares=2,
                      searched=False, takes=("order_costs",),
                      frame=lambda d, n, order_costs=EQUAL: _chimera_frame(d, n, "halving")))
register(ScheduleSpec("chimera4", chimera4, "Chimera with four pipelines (4/D of the model per worker)",
                      accepts=_four_pipes, backward=(True,), shares=4, takes=("order_costs",),
                      frame=_list_frame("chimera4", _chimera4_placement, _four_pipes)))

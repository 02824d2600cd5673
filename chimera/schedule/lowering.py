"""Lowering passes: compute-only lists → lists with send/recv, gradient sync and the optimizer step.

Each pass takes and returns a :class:`Schedule`; :func:`lower` applies them in order.

* :func:`add_p2p`: a receive right before the F or B that needs data from another worker, a send right
  after the F or B whose output another worker needs. A run of consecutive send/recv actions is one
  *communication batch*: the runtime posts it at once (``batch_isend_irecv``), waits for its receives
  and keeps the send handles; sends never block (see :mod:`chimera.schedule.replay`).
* :func:`add_grad_sync`: ALLREDUCE_START(stage) right after the last action making weight gradients (B or W) of that stage replica on the
  worker (after the communication batch that follows it, so that a batch is never split), ALLREDUCE_WAIT for every started stage at the end. Only where
  the stage group (all replicas over both pipes and W groups) has more than one member.
* :func:`add_optimizer_step`: OPTIMIZER_STEP as the last action of every worker.

:func:`post_validate` (an option, applied after :func:`lower`) replaces every worker's OPTIMIZER_STEP by a
STAGE_UPDATE of each of its stage replicas, as soon as the replica's gradients are complete (right after its
ALLREDUCE_WAIT; first, those that have no gradient sum), and one VALIDATE at the end (Zero Bubble's
post-validation: the global norm is checked after the updates, during the next step, and the updates are rolled
back and redone in the rare case that clipping or a non-finite norm changes them; ``chimera.runtime.post_validate``).

:func:`split_backward` (an option, not part of :func:`lower`) replaces every full backward B by its
input-gradient part I and its weight-gradient part W; the allreduce of a stage then starts after its last W.
"""

from __future__ import annotations

from collections.abc import Mapping

from chimera.schedule.ir import Action, Schedule, _replace
from chimera.schedule.kinds import PARTS, SPECS, TRANSFER, Kind, Res, Role, neighbour


def add_p2p(schedule: Schedule) -> Schedule:
    """Insert point-to-point send/receive actions around compute actions (from the kinds table).

    Before a compute action: the receive of every resource it consumes from a stage on another worker.
    After it: the send of every resource it produces that a stage on another worker consumes.
    """
    if schedule.lowered:
        raise ValueError("schedule is already lowered; call compute_only() first")
    place = schedule.placement
    rows = []
    for w, row in enumerate(schedule.actions):
        out: list[Action] = []
        around: dict[tuple[Kind, str, int], tuple[tuple[Kind, ...], tuple[Kind, ...]] | None] = {}
        for a in row:
            key = (a.kind, a.pipe, a.stage)
            if key not in around:  # per kind, pipe and stage on this worker: the receives before, the sends after
                around[key] = _transfers(a, w, place, schedule.stages)
            kinds = around[key]
            if kinds is None:
                out.append(a)
                continue
            recvs, sends = kinds
            for k in recvs:
                out.append(Action(k, a.pipe, a.stage, a.microbatch, a.count))
            out.append(a)
            for k in sends:
                out.append(Action(k, a.pipe, a.stage, a.microbatch, a.count))
        rows.append(out)
    return _replace(schedule, actions=in_channel_order(rows, place), lowered=True)


def _transfers(a: Action, w: int, place: Mapping[tuple[str, int], int], stages: int
               ) -> tuple[tuple[Kind, ...], tuple[Kind, ...]] | None:
    """The receive kinds that go right before compute action ``a`` on worker ``w`` and the send kinds right after
    it (from the kinds table); None for an action that is not compute."""
    spec = SPECS[a.kind]
    if spec.role is not Role.COMPUTE:
        return None
    recvs = []
    for use in spec.consumes:
        src = neighbour(a.stage, use.offset, stages)
        if use.res in TRANSFER and src is not None and place[(a.pipe, src)] != w:
            recvs.append(TRANSFER[use.res][1])
    sends = []
    for res in spec.produces:
        if res not in TRANSFER:
            continue
        send = TRANSFER[res][0]
        dst = neighbour(a.stage, SPECS[send].peer, stages)
        if dst is not None and place[(a.pipe, dst)] != w:
            sends.append(send)
    return tuple(recvs), tuple(sends)


def _p2p() -> dict[Kind, tuple[bool, int, Res | None]]:
    """Send/receive kind -> (whether it sends, the peer stage's offset, the resource it carries)."""
    return {k: (spec.role is Role.SEND, spec.peer, spec.carries) for k, spec in SPECS.items()
            if spec.role in (Role.SEND, Role.RECV)}


_Channel = tuple[int, int, str]  # sender, receiver, pipe


def in_channel_order(rows: list[list[Action]], place: Mapping[tuple[str, int], int]) -> list[list[Action]]:
    """Every worker's receives moved, where needed, so that it takes each channel's messages (sender, receiver,
    pipe) in the order the sender sends them: the runtime's channels match messages in posting order.

    A receive that a later message of its channel overtakes moves up to just before that message's receive, so
    two stages that send to one worker over one channel (the two legs of a V placement: stage s's activation and
    stage 2D-1-s's gradient) arrive in order. What a worker waits for does not change: the moved message left
    before the one its new place waits for. A row whose channels are in order already is kept as it is.
    """
    p2p = _p2p()
    sent: dict[_Channel, dict[tuple, int]] = {}
    for w, row in enumerate(rows):
        for a in row:
            info = p2p.get(a.kind)
            if info is not None and info[0]:  # a send: the message of its own stage's output
                ch = sent.setdefault((w, place[(a.pipe, a.stage + info[1])], a.pipe), {})
                ch.setdefault((info[2], a.stage, a.microbatch), len(ch))
    out = []
    for w, row in enumerate(rows):
        # each receive's channel and place in its send order (None: no send, left for the validator to report)
        pos: list[tuple[_Channel, int | None] | None] = []
        last: dict[_Channel, int] = {}
        ordered = True
        for a in row:
            info = p2p.get(a.kind)
            if info is None or info[0]:
                pos.append(None)
                continue
            peer = a.stage + info[1]  # a receive: the message of the peer stage's output
            ch = (place[(a.pipe, peer)], w, a.pipe)
            k = sent.get(ch, {}).get((info[2], peer, a.microbatch))
            pos.append((ch, k))
            if k is not None:
                ordered = ordered and k > last.get(ch, -1)
                last[ch] = k
        out.append(row if ordered else _reorder(row, pos))
    return out


def _reorder(row: list[Action], pos: list[tuple[_Channel, int | None] | None]) -> list[Action]:
    """``row`` with each receive preceded by the receives of its channel's earlier messages not yet taken."""
    recvs: dict[_Channel, dict[int, int]] = {}  # channel -> place in its send order -> index in row
    for i, p in enumerate(pos):
        if p is not None and p[1] is not None:
            recvs.setdefault(p[0], {}).setdefault(p[1], i)
    placed: dict[_Channel, int] = {}  # channel -> how many of its messages the row has taken
    new: list[Action] = []
    for i, a in enumerate(row):
        p = pos[i]
        if p is None or p[1] is None or recvs[p[0]][p[1]] != i:  # not a receive, no send, or a second receive
            new.append(a)
            continue
        ch, k = p
        new += [row[recvs[ch][j]] for j in range(placed.get(ch, 0), k + 1) if j in recvs[ch]]
        placed[ch] = max(placed.get(ch, 0), k + 1)
    return new


def add_grad_sync(schedule: Schedule) -> Schedule:
    """Start each stage replica's gradient sum after the last action making its weight gradients; wait for all
    at the end."""
    wgrad = {k for k, spec in SPECS.items() if Res.WGRAD in spec.produces}
    rows = []
    for row in schedule.actions:
        last_b: dict[tuple[str, int], int] = {}
        for i, a in enumerate(row):
            if a.kind in wgrad:
                last_b[(a.pipe, a.stage)] = i
        starts: dict[int, list[Action]] = {}
        waits: list[Action] = []
        for (p, s), i in last_b.items():
            if len(schedule.stage_group(s)) < 2:
                continue
            j = i + 1
            while j < len(row) and row[j].kind.is_p2p:
                j += 1  # after the communication batch that follows the backward: never split a batch
            starts.setdefault(j, []).append(Action(Kind.ALLREDUCE_START, p, s))
            waits.append(Action(Kind.ALLREDUCE_WAIT, p, s))
        out: list[Action] = []
        done = 0
        for i in sorted(starts):  # the row in pieces, each start before the action at its place
            out += row[done:i]
            out += starts[i]
            done = i
        out += row[done:]
        out.extend(sorted(waits, key=lambda a: (a.stage, a.pipe)))
        rows.append(out)
    return _replace(schedule, actions=rows, lowered=True)


def add_optimizer_step(schedule: Schedule) -> Schedule:
    """Append the optimizer step to every worker."""
    return _replace(schedule, actions=[[*row, Action(Kind.OPTIMIZER_STEP)] for row in schedule.actions], lowered=True)


def post_validate(schedule: Schedule) -> Schedule:
    """Every worker's optimizer step split into per-stage updates and one validation (module docstring). The
    updates follow every compute action of the worker, so the tied gradient sums (blocking, over the ranks holding
    either end of a tied pair) that the first of them runs wait for no message of this step."""
    rows = []
    for w, row in enumerate(schedule.actions):
        at = [i for i, a in enumerate(row) if a.kind is Kind.OPTIMIZER_STEP]
        if len(at) != 1 or at[0] != len(row) - 1:
            raise ValueError(f"worker {w}: post-validation needs one optimizer step, at the end of the list "
                             "(a schedule lowered by lower() without offload)")
        waited = {(a.pipe, a.stage) for a in row if a.kind is Kind.ALLREDUCE_WAIT}
        stages = sorted(schedule.stages_of(w), key=lambda k: (k[1], k[0]))
        first_wait = next((i for i, a in enumerate(row) if a.kind is Kind.ALLREDUCE_WAIT), len(row) - 1)
        if any(a.kind.is_compute for a in row[first_wait:]):
            raise ValueError(f"worker {w}: post-validation needs every gradient-sum wait after the last compute")
        out = [*row[:first_wait], *(Action(Kind.STAGE_UPDATE, p, s) for p, s in stages if (p, s) not in waited)]
        for a in row[first_wait:-1]:
            out.append(a)
            if a.kind is Kind.ALLREDUCE_WAIT:
                out.append(Action(Kind.STAGE_UPDATE, a.pipe, a.stage))
        rows.append([*out, Action(Kind.VALIDATE)])
    return _replace(schedule, actions=rows, lowered=True)


def lower(schedule: Schedule) -> Schedule:
    """Apply the lowering passes: p2p, gradient sync, optimizer step (offload adds its swaps after them:
    :func:`chimera.offload.lowering.lower`)."""
    return add_optimizer_step(add_grad_sync(add_p2p(schedule)))


def split_backward(schedule: Schedule) -> Schedule:
    """Every action of a kind that has parts (:data:`chimera.schedule.kinds.PARTS`: B -> I, W) replaced by its parts,
    in place and in order.

    The result trains exactly like the original; generators that move the W actions into bubbles start from it.
    Applies to compute-only schedules.
    """
    if schedule.lowered:
        raise ValueError("split_backward works on compute-only schedules; call compute_only() first")
    if not any(a.kind in PARTS for row in schedule.actions for a in row):
        return schedule  # split already (a builder that orders the parts itself)
    rows = [[Action(k, a.pipe, a.stage, a.microbatch, a.count) for a in row for k in PARTS.get(a.kind, (a.kind,))]
            for row in schedule.actions]
    return _replace(schedule, actions=rows)

"""Action kinds, declared once: what each kind consumes, produces and releases, its peer, its message, its cost.

Every pass reads this table: lowering (which send/receive a compute action needs), replay (how a kind
executes and what it waits for), the validator (which kinds appear once per micro-batch, in which order),
the simulator (which cost it charges, what it stashes) and the runtime worker (one handler per kind).

Resources flow between actions of one ``(pipe, microbatch)``, keyed by the stage that made them:

========  ====================================================================================
``act``   a stage's output activation, the input of the next stage
``grad``  the gradient with respect to a stage's input, the output gradient of the previous stage
``stash`` what a stage's backward needs from its forward (autograd graph, or inputs to recompute)
``wgrad`` a stage's weight gradients (of one micro-batch)
``wkeep`` what a split backward's weight-gradient part (W) needs from its input-gradient part (I)
========  ====================================================================================

A full backward ``B`` may be split into its input-gradient part ``I`` (on the critical path: it makes the
gradient the previous stage waits for) and its weight-gradient part ``W`` (movable into bubbles): the rows of
I and W name B as what they are ``part_of``, so a valid schedule runs, per micro-batch, either one B or one I
and one W, and W comes after I because it consumes what I produces. :data:`ACTIVATION_MEMORY` lists the
resources that count as stashed activations (what F keeps for B or I, what I keeps for W).

A :class:`Use` names a resource and the stage that makes it, relative to the action's own stage: the
forward of stage s consumes ``Use(ACT, -1)``, the activation made by stage s-1. A use whose producer stage
lies outside the pipe comes from the data (stage 0's input) or from the loss (the last stage's output
gradient). A send carries a resource to the neighbour ``peer`` stages away, a receive takes it from there.

Adding a kind: one row in :data:`SPECS`, one worker handler (``chimera.runtime.executor``), one cost field
(:class:`chimera.schedule.simulate.Costs`). A kind without a row is refused at import; a kind the worker
has no handler for is refused before the first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class Kind(str, Enum):
    """What an action does (its row in :data:`SPECS` says how)."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - torch.distributed.pipelining's code for the input-gradient backward
    W = "W"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    ALLREDUCE_START = "ALLREDUCE_START"
    ALLREDUCE_WAIT = "ALLREDUCE_WAIT"
    OPTIMIZER_STEP = "OPTIMIZER_STEP"
    SWAP_IN = "SWAP_IN"
    SWAP_OUT = "SWAP_OUT"
    GRAD_OUT = "GRAD_OUT"

    @property
    def spec(self) -> KindSpec:
        return SPECS[self]

    @property
    def is_compute(self) -> bool:
        return SPECS[self].role is Role.COMPUTE

    @property
    def is_p2p(self) -> bool:
        return SPECS[self].role in (Role.SEND, Role.RECV)

    @property
    def is_send(self) -> bool:
        return SPECS[self].role is Role.SEND


class Role(Enum):
    """How replay and the runtime execute a kind."""

    COMPUTE = "compute"  # runs stage modules; starts when its inputs exist
    SEND = "send"  # non-blocking: the message leaves now
    RECV = "recv"  # blocks until the message has arrived
    SYNC_START = "sync_start"  # non-blocking start of a stage group's gradient sum
    SYNC_WAIT = "sync_wait"  # blocks until every replica of the stage started the sum
    UPDATE = "update"  # the optimizer step
    COPY = "copy"  # moves a stage replica's weights or gradients between host and device memory (offload)
    PREFETCH = "prefetch"  # starts a host -> device copy of a stage's weights; its next compute waits for it


class Res(str, Enum):
    """Resources that actions consume, produce and release (module docstring)."""

    ACT = "act"
    GRAD = "grad"
    STASH = "stash"
    WGRAD = "wgrad"
    WKEEP = "wkeep"


class Address(Enum):
    """What an action of a kind names, which decides its text form."""

    MICROBATCH = "microbatch"  # pipe, stage, micro-batch(es): d0F3, d1RECV_F2-3
    STAGE = "stage"  # pipe, stage: d0AR_START
    NONE = "none"  # nothing: OPT


@dataclass(frozen=True)
class Use:
    """Resource ``res`` of the same micro-batch, made by the stage ``offset`` stages from the action's."""

    res: Res
    offset: int = 0


@dataclass(frozen=True)
class KindSpec:
    """One row of the table.

    Attributes:
        name: what it does, in words (error messages).
        code: text code (``d0F3``, ``d1SEND_F3``; torch.distributed.pipelining's where it has one).
        role: how it executes.
        address: what an action of this kind names.
        consumes / produces / releases: resources (compute kinds).
        once: appears exactly once per (pipe, stage, micro-batch) of a valid schedule.
        carries / peer: send and receive: the resource that travels and the neighbour stage offset of the
            peer (a send's resource is its own stage's; a receive's is the peer stage's).
        cost: the :class:`~chimera.schedule.simulate.Costs` field(s) the simulator charges, summed (``None``:
            free).
        part_of: a ``once`` kind this kind is one part of: per micro-batch, either that kind runs once or each of
            its parts runs once.
        busy: for a communication kind, the :class:`~chimera.schedule.simulate.Costs` field of the worker time it
            takes (posting and completing a message, packing and unpacking a gradient sum) beside the delay that
            ``cost`` names.
    """

    name: str
    code: str
    role: Role
    address: Address = Address.MICROBATCH
    consumes: tuple[Use, ...] = ()
    produces: tuple[Res, ...] = ()
    releases: tuple[Res, ...] = ()
    once: bool = False
    carries: Res | None = None
    peer: int = 0
    cost: str | tuple[str, ...] | None = None
    part_of: Kind | None = None
    busy: str | None = None


SPECS: dict[Kind, KindSpec] = {
    Kind.F: KindSpec("forward", "F", Role.COMPUTE, consumes=(Use(Res.ACT, -1),), produces=(Res.ACT, Res.STASH), once=True,
                     cost="fwd"),
    Kind.B: KindSpec("backward", "B", Role.COMPUTE, consumes=(Use(Res.STASH), Use(Res.GRAD, +1)), produces=(Res.GRAD, Res.WGRAD),
                     releases=(Res.STASH,), once=True, cost=("bwd", "wgrad")),
    Kind.I: KindSpec("input-gradient backward", "I", Role.COMPUTE, consumes=(Use(Res.STASH), Use(Res.GRAD, +1)),
                     produces=(Res.GRAD, Res.WKEEP), releases=(Res.STASH,), once=True, cost="bwd", part_of=Kind.B),
    Kind.W: KindSpec("weight-gradient backward", "W", Role.COMPUTE, consumes=(Use(Res.WKEEP),), produces=(Res.WGRAD,),
                     releases=(Res.WKEEP,), once=True, cost="wgrad", part_of=Kind.B),
    Kind.SEND_ACT: KindSpec("activation send", "SEND_F", Role.SEND, carries=Res.ACT, peer=+1, cost="message",
                            busy="p2p_busy"),
    Kind.RECV_ACT: KindSpec("activation receive", "RECV_F", Role.RECV, carries=Res.ACT, peer=-1, cost="message",
                            busy="p2p_busy"),
    Kind.SEND_GRAD: KindSpec("gradient send", "SEND_B", Role.SEND, carries=Res.GRAD, peer=-1, cost="message",
                             busy="p2p_busy"),
    Kind.RECV_GRAD: KindSpec("gradient receive", "RECV_B", Role.RECV, carries=Res.GRAD, peer=+1, cost="message",
                             busy="p2p_busy"),
    Kind.ALLREDUCE_START: KindSpec("gradient allreduce start", "AR_START", Role.SYNC_START, Address.STAGE, consumes=(Use(Res.WGRAD),),
                                   cost="allreduce", busy="sync_start"),
    Kind.ALLREDUCE_WAIT: KindSpec("gradient allreduce wait", "AR_WAIT", Role.SYNC_WAIT, Address.STAGE,
                                  busy="sync_wait"),
    Kind.OPTIMIZER_STEP: KindSpec("optimizer step", "OPT", Role.UPDATE, Address.NONE, cost="optimizer"),
    # offload (chimera.schedule.lowering.add_offload): the host holds the current weights, so a swap-out only
    # releases the device copy; gradients move out and are summed on the host
    Kind.SWAP_IN: KindSpec("weights swap-in", "SWAP_IN", Role.PREFETCH, Address.STAGE, cost="swap_in"),
    Kind.SWAP_OUT: KindSpec("weights swap-out", "SWAP_OUT", Role.COPY, Address.STAGE),
    Kind.GRAD_OUT: KindSpec("gradients swap-out", "GRAD_OUT", Role.COPY, Address.STAGE, cost="swap_out"),
}

missing = [k for k in Kind if k not in SPECS]
if missing:  # pragma: no cover - a developer error, caught at import
    raise RuntimeError(f"action kinds without a row in chimera.schedule.kinds.SPECS: {missing}")

#: resources that hold a micro-batch's activations (the simulator's peak activation memory counts them)
ACTIVATION_MEMORY: tuple[Res, ...] = (Res.STASH, Res.WKEEP)
#: a once kind -> the kinds that are its parts (B -> I, W)
PARTS: dict[Kind, tuple[Kind, ...]] = {
    whole: tuple(k for k, s in SPECS.items() if s.part_of is whole) for whole in {s.part_of for s in SPECS.values()}
    if whole is not None
}

KIND_OF_CODE: dict[str, Kind] = {spec.code: kind for kind, spec in SPECS.items()}
#: resource -> (the kind that sends it, the kind that receives it)
TRANSFER: dict[Res, tuple[Kind, Kind]] = {
    spec.carries: (kind, next(k for k, s in SPECS.items() if s.role is Role.RECV and s.carries is spec.carries))
    for kind, spec in SPECS.items() if spec.role is Role.SEND and spec.carries is not None
}
for _res, (_send, _recv) in TRANSFER.items():  # a receive takes from where the matching send puts
    if SPECS[_send].peer != -SPECS[_recv].peer:  # pragma: no cover - developer error
        raise RuntimeError(f"{_send} and {_recv} disagree on the neighbour stage")


class Msg(NamedTuple):
    """The typed key of one message or local hand-off: resource ``res`` of ``microbatch`` made by ``stage``."""

    res: Res
    pipe: str
    stage: int
    microbatch: int


def neighbour(stage: int, offset: int, stages: int) -> int | None:
    """Stage ``stage + offset`` of a pipe of ``stages`` stages, or ``None`` past either end."""
    other = stage + offset
    return other if 0 <= other < stages else None


def message(kind: Kind, pipe: str, stage: int, microbatch: int) -> tuple[Msg, int]:
    """The message a send/receive action carries and its peer stage (same pipe).

    A send names the stage whose output travels; a receive names the stage that needs it, so
    ``SEND_ACT(s)`` pairs with ``RECV_ACT(s+1)`` and ``SEND_GRAD(s)`` with ``RECV_GRAD(s-1)``.
    """
    spec = SPECS[kind]
    if spec.carries is None:
        raise ValueError(f"{kind.value} is not a send/receive kind")
    peer = stage + spec.peer
    made_by = stage if spec.role is Role.SEND else peer
    return Msg(spec.carries, pipe, made_by, microbatch), peer

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

Adding a kind: one :func:`register_kind` call with its row (what it consumes and produces, its role, its device-
memory effect, its display family, the cost field it charges), one worker handler
(``chimera.runtime.handlers.register_handler``) and, where it needs a new one, one cost field
(:class:`chimera.schedule.simulate.Costs`). A kind's value is its text code (``F``, ``SEND_F``, ``AR_START``,
``OPT``): the same name in the text form, the JSON form, the timeline and the docs. A kind travels with its row
when pickled, so a worker knows a kind registered only where the job was compiled; a kind the worker has no handler
for is refused before the first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any, NamedTuple


class Kind(str):
    """What an action does: its text code; its row in :data:`SPECS` says how. The built-in kinds are attributes
    (``Kind.F``, ``Kind.SEND_ACT``); ``Kind("SEND_F")`` looks one up by its code."""

    __slots__ = ()

    def __new__(cls, value: str) -> Kind:
        kind = _BY_CODE.get(value) or _BY_CODE.get(_LEGACY.get(value, ""))
        if kind is None:
            raise ValueError(f"unknown action kind {value!r}; known: {', '.join(_BY_CODE)}")
        return kind

    @property
    def value(self) -> str:
        """The text code."""
        return str.__str__(self)

    @property
    def name(self) -> str:
        """The attribute name (``SEND_ACT`` for ``SEND_F``)."""
        return _NAMES[self]

    def __repr__(self) -> str:
        return f"Kind.{self.name}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (self.name, SPECS[self]))

    def __copy__(self) -> Kind:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Kind:
        return self

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

    # the built-in kinds (assigned by register_kind below)
    F: Kind
    B: Kind
    I: Kind  # noqa: E741 - torch.distributed.pipelining's code for the input-gradient backward
    W: Kind
    SEND_ACT: Kind
    RECV_ACT: Kind
    SEND_GRAD: Kind
    RECV_GRAD: Kind
    ALLREDUCE_START: Kind
    ALLREDUCE_WAIT: Kind
    OPTIMIZER_STEP: Kind
    STAGE_UPDATE: Kind
    VALIDATE: Kind
    SWAP_IN: Kind
    SWAP_OUT: Kind
    GRAD_OUT: Kind


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


class Res(StrEnum):
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
class Memory:
    """What an action does to the device memory of its stage replica's worker; the memory model
    (``chimera.plan.memory``) walks these and the runtime's ledger measures what they predict. Activation units
    held follow from the resources a kind produces and releases (:data:`ACTIVATION_MEMORY`).

    Attributes:
        grads: the stage's weight gradients are allocated (True) or leave the device (False).
        flat: the stage's flat gradient-sum buffers are allocated (True) or released, the sum written back into
            the gradients (False; a gloo replica pair's peer bucket, posted when the step starts, goes then too).
        resident: the stage's weights come onto the device (True) or leave it (False).
        transient: held only while it runs: ``out`` (its outgoing message), ``in`` (an incoming one),
            ``recompute`` (a recomputing backward's whole stash), ``pack`` (weights streamed in packs).
        peak: the state while it runs can be the worker's peak.
        saved: a copy of the stage's weights and optimizer state is kept from here to the next step's first such
            action, which releases it with the step's gradients set aside (a post-validated update's rollback copy;
            a list with such a kind starts carrying the previous step's).
    """

    grads: bool | None = None
    flat: bool | None = None
    resident: bool | None = None
    transient: tuple[str, ...] = ()
    peak: bool = False
    saved: bool = False


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
        memory: its device-memory effect (:class:`Memory`).
        family: how timelines draw it (``forward``, ``backward``, ``weight``, ``message``, ``sync``, ``update``,
            ``swap-in``, ``swap-out``, ``grad-out``; another name gets a neutral colour).
        module: the module that registers the kind and its worker handler (a worker imports it when it meets the
            kind without a handler); empty for the built-in kinds.
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
    memory: Memory = Memory()
    family: str = "other"
    module: str = ""


SPECS: dict[Kind, KindSpec] = {}
#: resources that hold a micro-batch's activations (the simulator's peak activation memory counts them)
ACTIVATION_MEMORY: tuple[Res, ...] = (Res.STASH, Res.WKEEP)
#: a once kind -> the kinds that are its parts (B -> I, W)
PARTS: dict[Kind, tuple[Kind, ...]] = {}
KIND_OF_CODE: dict[str, Kind] = {}
#: resource -> (the kind that sends it, the kind that receives it)
TRANSFER: dict[Res, tuple[Kind, Kind]] = {}
_BY_CODE = KIND_OF_CODE
_NAMES: dict[Kind, str] = {}
_LEGACY: dict[str, str] = {}  # attribute names as codes (JSON written before the codes were the names)
#: bumped by every registration: caches derived from the table (text patterns) check it
VERSION = [0]


def _derive() -> None:
    """The tables derived from :data:`SPECS`, recomputed in place."""
    PARTS.clear()
    for whole in {s.part_of for s in SPECS.values() if s.part_of is not None}:
        PARTS[whole] = tuple(k for k, s in SPECS.items() if s.part_of is whole)
    TRANSFER.clear()
    for kind, spec in SPECS.items():
        if spec.role is Role.SEND and spec.carries is not None:
            recv = next((k for k, s in SPECS.items() if s.role is Role.RECV and s.carries is spec.carries), None)
            if recv is not None:
                if SPECS[recv].peer != -spec.peer:
                    raise ValueError(f"{kind} and {recv} disagree on the neighbour stage")
                TRANSFER[spec.carries] = (kind, recv)
    VERSION[0] += 1


def register_kind(name: str, spec: KindSpec) -> Kind:
    """Add an action kind (``Kind.<name>``, value ``spec.code``) with its row; returns it. Registering the same
    row again returns the kind; another row under a taken name or code is refused."""
    have = _BY_CODE.get(spec.code)
    if have is not None:
        if SPECS[have] == spec and _NAMES[have] == name:
            return have
        raise ValueError(f"action kind code {spec.code!r} is taken by Kind.{_NAMES[have]}")
    if name in _NAMES.values() or not name.isidentifier():
        raise ValueError(f"action kind name {name!r} is taken or not an identifier")
    kind = str.__new__(Kind, spec.code)
    setattr(Kind, name, kind)
    _NAMES[kind] = name
    _BY_CODE[spec.code] = kind
    if name != spec.code:
        _LEGACY[name] = spec.code
    SPECS[kind] = spec
    _derive()
    return kind


def _restore(name: str, spec: KindSpec) -> Kind:
    """Unpickling: the kind of that code, registered from its row where this process lacks it."""
    return _BY_CODE.get(spec.code) or register_kind(name, spec)


_COMPUTE_MEMORY = Memory(grads=True, transient=("recompute", "out", "in", "pack"), peak=True)
register_kind("F", KindSpec("forward", "F", Role.COMPUTE, consumes=(Use(Res.ACT, -1),), produces=(Res.ACT, Res.STASH),
                            once=True, cost="fwd", memory=Memory(transient=("out", "pack"), peak=True),
                            family="forward"))
register_kind("B", KindSpec("backward", "B", Role.COMPUTE, consumes=(Use(Res.STASH), Use(Res.GRAD, +1)),
                            produces=(Res.GRAD, Res.WGRAD), releases=(Res.STASH,), once=True, cost=("bwd", "wgrad"),
                            memory=_COMPUTE_MEMORY, family="backward"))
register_kind("I", KindSpec("input-gradient backward", "I", Role.COMPUTE, consumes=(Use(Res.STASH), Use(Res.GRAD, +1)),
                            produces=(Res.GRAD, Res.WKEEP), releases=(Res.STASH,), once=True, cost="bwd",
                            part_of=Kind.B, memory=_COMPUTE_MEMORY, family="backward"))
register_kind("W", KindSpec("weight-gradient backward", "W", Role.COMPUTE, consumes=(Use(Res.WKEEP),),
                            produces=(Res.WGRAD,), releases=(Res.WKEEP,), once=True, cost="wgrad", part_of=Kind.B,
                            family="weight"))
register_kind("SEND_ACT", KindSpec("activation send", "SEND_F", Role.SEND, carries=Res.ACT, peer=+1, cost="message",
                                   busy="p2p_busy", family="message"))
register_kind("RECV_ACT", KindSpec("activation receive", "RECV_F", Role.RECV, carries=Res.ACT, peer=-1,
                                   cost="message", busy="p2p_busy", family="message"))
register_kind("SEND_GRAD", KindSpec("gradient send", "SEND_B", Role.SEND, carries=Res.GRAD, peer=-1, cost="message",
                                    busy="p2p_busy", family="message"))
register_kind("RECV_GRAD", KindSpec("gradient receive", "RECV_B", Role.RECV, carries=Res.GRAD, peer=+1,
                                    cost="message", busy="p2p_busy", family="message"))
register_kind("ALLREDUCE_START", KindSpec("gradient allreduce start", "AR_START", Role.SYNC_START, Address.STAGE,
                                          consumes=(Use(Res.WGRAD),), cost="allreduce", busy="sync_start",
                                          memory=Memory(flat=True, peak=True), family="sync"))
register_kind("ALLREDUCE_WAIT", KindSpec("gradient allreduce wait", "AR_WAIT", Role.SYNC_WAIT, Address.STAGE,
                                         busy="sync_wait", memory=Memory(flat=False), family="sync"))
register_kind("OPTIMIZER_STEP", KindSpec("optimizer step", "OPT", Role.UPDATE, Address.NONE, cost="optimizer",
                                         family="update"))
# post-validated steps (chimera.schedule.lowering.post_validate, chimera.runtime.post_validate): each stage replica
# updated as soon as its gradients are complete (``stage_update``: a per-stage cost, 0 unless the costs name it),
# then VALIDATE starts the sum of the global gradient norm and the worker goes on; the next step's first update
# takes the verdict (the steps simulator gates it on every worker's VALIDATE), which rolls the updates back and
# redoes or skips them where clipping or a non-finite norm changes them (the rare case: that next step then runs
# twice; not modelled). Each update keeps its stage's weights and optimizer state, and the step's gradients are set
# aside, until that verdict (the memory model carries them into the next step up to its first update)
register_kind("STAGE_UPDATE", KindSpec("stage update (post-validated)", "UPDATE", Role.UPDATE, Address.STAGE,
                                       cost="stage_update", memory=Memory(saved=True, peak=True), family="update"))
register_kind("VALIDATE", KindSpec("post-validation of the step (its start)", "VALIDATE", Role.UPDATE, Address.NONE,
                                   family="update"))
# offload (chimera.offload.lowering): the host holds the current weights, so a swap-out only releases the device
# copy; gradients move out and are summed on the host
register_kind("SWAP_IN", KindSpec("weights swap-in", "SWAP_IN", Role.PREFETCH, Address.STAGE, cost="swap_in",
                                  memory=Memory(resident=True, peak=True), family="swap-in"))
register_kind("SWAP_OUT", KindSpec("weights swap-out", "SWAP_OUT", Role.COPY, Address.STAGE,
                                   memory=Memory(resident=False), family="swap-out"))
register_kind("GRAD_OUT", KindSpec("gradients swap-out", "GRAD_OUT", Role.COPY, Address.STAGE, cost="swap_out",
                                   memory=Memory(grads=False), family="grad-out"))


def activation_change(kind: Kind) -> int:
    """Activation units an action of ``kind`` adds (+) or releases (-) per micro-batch, from what it produces and
    releases."""
    spec = SPECS[kind]
    return sum(r in ACTIVATION_MEMORY for r in spec.produces) - sum(r in ACTIVATION_MEMORY for r in spec.releases)


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

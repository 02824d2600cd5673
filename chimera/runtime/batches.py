"""A worker's communication batches: runs of send/receive actions of its schedule, posted at once through the
:class:`~chimera.runtime.comm.Communicator`, with receives posted ahead on gloo."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from chimera.job import Job
from chimera.runtime.comm import Communicator, Op
from chimera.runtime.step_state import StepState
from chimera.schedule import Action
from chimera.schedule.kinds import Msg, Res, message


class CommBatches:
    """Posts one worker's communication batches and keeps their handles for a step.

    A batch is a run of consecutive send/receive actions (``segments[k]``): its sends take their tensors from
    the step's outbox, its receives fill buffers shaped from the job's boundary specs and land in the step's
    inbox. Sends never block; their handles are waited for before the optimizer step (:meth:`wait_sends`). On gloo,
    which posts every op on its own, a batch's sends go out before its receive buffers are made: the peer's wait
    for the message does not include this rank's allocations (on NCCL a batch is one group call).

    On gloo the receives of the next batch are posted together with the current one, one compute action
    early: gloo moves a message only once its receive is posted, so a receive posted at the last moment costs
    a notify round trip on the critical path, and one posted early finds the data there. Small receives go
    further ahead: the batches after that one too, while their buffers total at most ``AHEAD_BYTES`` (at most
    ``AHEAD_BATCHES`` batches), so that the peer finds their notifies waiting and writes each message from its own
    thread at once, its transport thread woken for fewer notifies (1F1B, D = 4, no sleeps, 2 cores: ~30 % less CPU
    per step on the middle ranks, ~18 % shorter steps); large receives never hold more than the next batch's
    buffers. Per channel the receives are still posted in schedule order, so messages match as validated. Not on
    NCCL, where an early receive would block later sends on the same stream.
    """

    def __init__(self, comm: Communicator, job: Job, worker: int, segments: Sequence[Sequence[Action]],
                 device: torch.device, describe: Callable[[Action, int], str]) -> None:
        self.comm = comm
        self.job = job
        self.worker = worker
        self.segments = segments
        self.device = device
        self.describe = describe
        comm_idx = [k for k, seg in enumerate(segments) if seg[0].kind.is_p2p]
        # every batch resolved once per job: its sends (action, message, peer, group) and receives (the same and
        # the buffers' shapes), so that a step looks nothing up
        self.sends: dict[int, list[tuple[Action, Msg, int, Any]]] = {}
        self.recvs: dict[int, list[tuple[Action, Msg, int, Any, list[tuple[tuple[int, ...], torch.dtype]]]]] = {}
        for k in comm_idx:
            batch = segments[k]
            self.sends[k] = [(a, *self._peer(a)) for a in batch if a.kind.is_send]
            self.recvs[k] = [(a, *self._peer(a), self._shapes(a)) for a in batch if not a.kind.is_send]
        # gloo posts every op on its own: each send posted by a call bound to its route, before the batch's receives
        self.senders = {k: [(a, msg, comm.sender(rank, group)) for a, msg, rank, group in sends]
                        for k, sends in self.sends.items()} if comm.prefetch_recvs else {}
        # per batch, the batches whose receives are posted with it (on gloo): the next one, then small ones
        self.ahead = _ahead(comm_idx, {k: _nbytes(self.recvs[k]) for k in comm_idx}) if comm.prefetch_recvs else {}
        self.prefetched: dict[int, list[tuple[Action, Msg, tuple[torch.Tensor, ...], list[Any]]]] = {}
        self.send_works: list[tuple[Any, Action, int, torch.Tensor]] = []
        #: work for the wait: called with the batch index and the step's state after a batch is posted, before its
        #: receives are waited for (the worker loads the next forward's data there)
        self.while_waiting: Callable[[int, StepState], None] | None = None

    def _peer(self, a: Action) -> tuple[Msg, int, Any]:
        msg, stage = message(a.kind, a.pipe, a.stage, a.microbatch)
        return msg, self.comm.global_rank(self.job.schedule.placement[(a.pipe, stage)]), self.comm.pipe_groups[a.pipe]

    def _shapes(self, a: Action) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the receive buffers of ``a``: a stage's output, or the gradient of its inputs, for
        ``a.count`` units."""
        msg, _ = message(a.kind, a.pipe, a.stage, a.microbatch)
        if msg.res is Res.ACT:
            specs = self.job.stage_inputs(msg.stage + 1)
        else:
            specs = [s for s in self.job.stage_inputs(msg.stage) if s.requires_grad]
        return [((s.shape[0] * a.count, *s.shape[1:]), s.dtype) for s in specs]

    def exchange(self, k: int, st: StepState) -> None:
        """Post batch ``k``'s sends (and its receives unless prefetched); wait for its receives."""
        ops: list[Op] = []
        owners: list[tuple[Action, list[Any] | None]] = []
        outbox, step = st.outbox, st.step
        earlier = len(self.send_works)  # the sends posted before: those completed are dropped once these are out
        if self.senders:  # the sends go out before any receive buffer is made
            for a, msg, send in self.senders[k]:
                for t in outbox.pop(msg):
                    self.send_works.append((send(t), a, step, t))
        else:  # NCCL: the batch is one group call
            for a, msg, rank, group in self.sends[k]:
                for t in outbox.pop(msg):
                    ops.append(Op(True, t, rank, group))
                    owners.append((a, None))
        recvs = self.prefetched.pop(k, None)
        if recvs is None:
            recvs = self._recv_ops(k, ops, owners)
        for ahead in self.ahead.get(k, ()):
            if ahead not in self.prefetched:  # in batch order: what an earlier batch posted is a prefix
                self.prefetched[ahead] = self._recv_ops(ahead, ops, owners)
        for op, (a, slot), w in zip(ops, owners, self.comm.post(ops) if ops else ()):
            if op.is_send:
                self.send_works.append((w, a, step, op.tensor))
            else:
                slot.append(w)  # type: ignore[union-attr]
        if earlier:
            self._drop_finished_sends(earlier)
        if self.while_waiting is not None:
            self.while_waiting(k, st)
        for a, msg, tensors, works in recvs:
            for w in works:
                self.comm.wait(w, lambda a=a: self.describe(a, step))
            st.inbox[msg] = tensors

    def _recv_ops(self, k: int, ops: list[Op], owners: list[tuple[Action, list[Any] | None]]
                  ) -> list[tuple[Action, Msg, tuple[torch.Tensor, ...], list[Any]]]:
        """Append the receives of batch ``k`` to ``ops``; return (action, key, buffers, works filled on post)."""
        out = []
        device = self.device
        for a, msg, rank, group, shapes in self.recvs[k]:
            tensors = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes)
            works: list[Any] = []
            for t in tensors:
                ops.append(Op(False, t, rank, group))
                owners.append((a, works))
            out.append((a, msg, tensors, works))
        return out

    def _drop_finished_sends(self, earlier: int) -> None:
        """Forget those of the first ``earlier`` sends in flight that completed (their errors still surface), and
        with them the tensors they kept."""
        pending = []
        for x in self.send_works[:earlier]:
            if x[0] is not None and x[0].is_completed():
                self.comm.wait(x[0], lambda x=x: self.describe(x[1], x[2]))
            else:
                pending.append(x)
        self.send_works[:earlier] = pending

    def wait_sends(self) -> None:
        """Wait for every send posted so far (before the optimizer step reuses the memory)."""
        for w, a, step, _ in self.send_works:
            self.comm.wait(w, lambda a=a, step=step: self.describe(a, step))
        self.send_works.clear()

    def held(self) -> list[torch.Tensor]:
        """Tensors the batches keep alive: sends in flight and receive buffers posted early."""
        return [x[3] for x in self.send_works] + [t for recvs in self.prefetched.values() for _, _, ts, _ in recvs
                                                  for t in ts]


#: gloo: receives posted ahead beyond the next batch's, while their buffers total at most this (bytes) ...
AHEAD_BYTES = 64 * 1024
#: ... in at most this many batches ahead
AHEAD_BATCHES = 8


def _nbytes(recvs: Sequence[tuple[Any, ...]]) -> int:
    """Bytes of the receive buffers of one batch (``CommBatches.recvs[k]``)."""
    return sum(math.prod(shape) * dtype.itemsize for *_, shapes in recvs for shape, dtype in shapes)


def _ahead(comm_idx: Sequence[int], nbytes: Mapping[int, int]) -> dict[int, list[int]]:
    """Per communication batch, the batches after it whose receives are posted with it: always the next, then the
    following ones while their buffers total at most ``AHEAD_BYTES``, at most ``AHEAD_BATCHES`` in all."""
    out: dict[int, list[int]] = {}
    for i, k in enumerate(comm_idx):
        later = list(comm_idx[i + 1:i + 1 + AHEAD_BATCHES])
        take, extra = later[:1], 0
        for j in later[1:]:
            extra += nbytes[j]
            if extra > AHEAD_BYTES:
                break
            take.append(j)
        out[k] = take
    return out

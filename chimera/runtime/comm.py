"""The one communication layer: torch.distributed p2p batches, bucketed gradient allreduce, timeouts.

Process groups (created in the same order on every rank):

* one p2p group per pipe, so messages of the down and up pipes between the same two workers can never be
  confused (NCCL matches p2p messages per communicator in posting order);
* one group per stage with more than one replica (``Schedule.stage_group``: both Chimera replicas over
  all W data-parallel groups) for the gradient allreduce;
* one group for tied weights (the ranks holding the first or the last stage), when the model ties them;
* the default group (all ranks) for the global gradient norm.

Every wait has a deadline; a stall raises :class:`StallError` naming the worker, the action and the
micro-batch.

Payload modes: ``full`` (training) or ``single-byte`` (profiling compute alone): every p2p message and
every allreduce carries one byte; a receiver zero-fills its buffer and allreduced tensors keep their local
values, so results of such a run are not training results. The communicator counts the bytes of every
message and allreduce it sends (:meth:`Communicator.payload_sizes`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from chimera.schedule import Schedule


class StallError(RuntimeError):
    """A blocking wait ran past the timeout."""


PAYLOADS = ("full", "single-byte")


class Communicator:
    """Process groups and timed waits for one rank of a pipeline job."""

    def __init__(self, schedule: Schedule, rank: int, tied_ranks: Sequence[int] = (), timeout_s: float = 120.0,
                 worker_name: str = "", payload: str = "full") -> None:
        if payload not in PAYLOADS:
            raise ValueError(f"payload must be one of {PAYLOADS}, got {payload!r}")
        self.single_byte = payload == "single-byte"
        self._sizes: Counter[int] = Counter()
        self.schedule = schedule
        self.rank = rank
        self.timeout_s = timeout_s
        self.name = worker_name or f"worker {rank}"
        self.backend = dist.get_backend()
        # gloo posts each op independently; NCCL orders a communicator's ops on one stream
        self.prefetch_recvs = self.backend == "gloo"
        world = dist.get_world_size()
        self.pipe_groups = {pipe: dist.new_group(list(range(world))) for pipe in schedule.pipes}
        self.stage_groups: dict[int, dist.ProcessGroup] = {}
        for s in range(schedule.stages):
            ranks = schedule.stage_group(s)
            if len(ranks) > 1:
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.stage_groups[s] = group
        self.tied_group = None
        if len(tied_ranks) > 1:
            group = dist.new_group(sorted(tied_ranks))
            if rank in tied_ranks:
                self.tied_group = group

    def global_rank(self, worker: int) -> int:
        """Global rank of ``worker`` in this rank's data-parallel group."""
        return (self.rank // self.schedule.workers) * self.schedule.workers + worker

    def start_step(self) -> None:
        """Reset the per-step payload counter."""
        self._sizes.clear()

    def payload_sizes(self) -> dict[int, int]:
        """Bytes per message or allreduce sent by this rank in the current step -> count."""
        return dict(self._sizes)

    def _payload(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.uint8, device=t.device) if self.single_byte else t

    def post(self, ops: list[tuple[str, bool, torch.Tensor, int]]) -> list[dist.Work]:
        """Post one communication batch: ``(pipe, is_send, tensor, peer_rank)`` items; returns works in order.

        In single-byte mode a receive's buffer is zero-filled and one byte travels instead.
        """
        if self.single_byte:
            for _, is_send, t, _ in ops:
                if not is_send:
                    t.zero_()
            ops = [(pipe, is_send, self._payload(t), peer) for pipe, is_send, t, peer in ops]
        for _, is_send, t, _ in ops:
            if is_send:
                self._sizes[t.numel() * t.element_size()] += 1
        works: list[dist.Work] = [None] * len(ops)  # type: ignore[list-item]
        by_pipe: dict[str, list[int]] = {}
        for i, (pipe, _, _, _) in enumerate(ops):
            by_pipe.setdefault(pipe, []).append(i)
        for pipe, idx in by_pipe.items():
            group = self.pipe_groups[pipe]
            p2p = [dist.P2POp(dist.isend if ops[i][1] else dist.irecv, ops[i][2], ops[i][3], group) for i in idx]
            for i, w in zip(idx, dist.batch_isend_irecv(p2p)):
                works[i] = w
        return works

    def p2p(self, is_send: bool, t: torch.Tensor, peer: int, group: dist.ProcessGroup | None) -> dist.Work:
        """Post one send or receive of ``t`` to/from global rank ``peer`` in ``group`` (one byte in single-byte mode)."""
        buf = self._payload(t)
        if is_send:
            self._sizes[buf.numel() * buf.element_size()] += 1
            return dist.isend(buf, peer, group=group)
        return dist.irecv(buf, peer, group=group)

    def allreduce_async(self, t: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, dist.Work]:
        """Start a SUM allreduce of ``t`` (one byte in single-byte mode); returns (result tensor, work)."""
        buf = self._payload(t)
        self._sizes[buf.numel() * buf.element_size()] += 1
        return t, dist.all_reduce(buf, group=group, async_op=True)

    def allreduce(self, t: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> torch.Tensor:
        """SUM-allreduce ``t`` in place with the timeout; returns ``t``."""
        t, work = self.allreduce_async(t, group)
        self.wait(work, what)
        return t

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` at most ``timeout_s``; raise :class:`StallError` describing ``what``."""
        if work is None:
            return
        try:
            if self.backend == "gloo":
                work.wait(timedelta(seconds=self.timeout_s))
                return
            deadline = time.monotonic() + self.timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise StallError("timeout")
                time.sleep(0.0005)
            work.wait()
        except (RuntimeError, StallError) as e:
            raise StallError(f"{self.name} stalled: {what} did not complete within {self.timeout_s:g} s "
                             f"(--timeout); the peer is slow, dead or waiting elsewhere [{str(e).splitlines()[0][:200]}]"
                             ) from None


class GradBuckets:
    """Bucketed, asynchronous SUM-allreduce of a set of parameters' gradients over one group.

    Where the group is a pair of replicas and receives may be posted early (gloo), the sum is an exchange:
    :meth:`prepost` posts the receive of the peer's bucket at the start of the step, :meth:`start` sends
    this replica's bucket, :meth:`wait` adds the two. That is one message latency instead of the two
    rounds of a two-rank ring allreduce, for the same bytes; both replicas compute ``a + b == b + a``
    bitwise. Other groups use ``all_reduce``.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None, comm: Communicator,
                 ranks: Sequence[int] = (), bucket_bytes: int = 25 * 2**20) -> None:
        self.group = group
        self.comm = comm
        others = [r for r in ranks if r != comm.rank]
        self.peer = others[0] if len(ranks) == 2 and len(others) == 1 and comm.prefetch_recvs else None
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in params:
            if not self.buckets or size + p.numel() * p.element_size() > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._incoming: list[tuple[torch.Tensor, dist.Work]] = []
        self._pending: list[tuple[list[torch.nn.Parameter], torch.Tensor, list[dist.Work], torch.Tensor | None]] = []

    def prepost(self) -> None:
        """Post the receives of the peer's buckets (exchange mode only; once per step, before :meth:`start`)."""
        if self.peer is None or self._incoming:
            return
        for bucket in self.buckets:
            buf = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            self._incoming.append((buf, self.comm.p2p(False, buf, self.peer, self.group)))

    def start(self) -> None:
        """Launch the sum of every bucket (non-blocking)."""
        if self.peer is not None:
            self.prepost()
        for i, bucket in enumerate(self.buckets):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = _flatten_dense_tensors(grads)
            if self.peer is None:
                flat, work = self.comm.allreduce_async(flat, self.group)
                self._pending.append((bucket, flat, [work], None))
            else:
                buf, recv = self._incoming[i]
                self._pending.append((bucket, flat, [recv, self.comm.p2p(True, flat, self.peer, self.group)], buf))
        self._incoming.clear()

    def wait(self, what: str) -> None:
        """Wait for the sums and write them back into the gradients."""
        for bucket, flat, works, peer_flat in self._pending:
            for work in works:
                self.comm.wait(work, what)
            if peer_flat is not None and not self.comm.single_byte:
                flat.add_(peer_flat)
            for p, g in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        self._pending.clear()

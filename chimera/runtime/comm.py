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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from chimera.schedule import Schedule


class StallError(RuntimeError):
    """A blocking wait ran past the timeout."""


class Communicator:
    """Process groups and timed waits for one rank of a pipeline job."""

    def __init__(self, schedule: Schedule, rank: int, tied_ranks: Sequence[int] = (), timeout_s: float = 120.0,
                 worker_name: str = "") -> None:
        self.schedule = schedule
        self.rank = rank
        self.timeout_s = timeout_s
        self.name = worker_name or f"worker {rank}"
        self.backend = dist.get_backend()
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

    def post(self, ops: list[tuple[str, bool, torch.Tensor, int]]) -> list[dist.Work]:
        """Post one communication batch: ``(pipe, is_send, tensor, peer_rank)`` items; returns works in order."""
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
    """Bucketed, asynchronous SUM-allreduce of a set of parameters' gradients over one group."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None,
                 bucket_bytes: int = 25 * 2**20) -> None:
        self.group = group
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in params:
            if not self.buckets or size + p.numel() * p.element_size() > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._pending: list[tuple[list[torch.nn.Parameter], torch.Tensor, dist.Work]] = []

    def start(self) -> None:
        """Launch the allreduce of every bucket (non-blocking)."""
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = _flatten_dense_tensors(grads)
            self._pending.append((bucket, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def wait(self, comm: Communicator, what: str) -> None:
        """Wait for the allreduces and write the summed gradients back."""
        for bucket, flat, work in self._pending:
            comm.wait(work, what)
            for p, g in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        self._pending.clear()

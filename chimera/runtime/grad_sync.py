"""Gradient sums over a stage's replicas: bucketed, asynchronous, started right after the stage's last backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from chimera.runtime.comm import Communicator, Op


class GradBuckets:
    """Bucketed, asynchronous SUM-allreduce of a set of parameters' gradients over one group.

    Where the group is a pair of replicas and receives may be posted early (gloo, which every host group is:
    ``Communicator.posts_early``), the sum is an exchange:
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
        self.peer = others[0] if len(ranks) == 2 and len(others) == 1 and comm.posts_early(group) else None
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

    def messages(self) -> dict[tuple[dist.ProcessGroup | None, int], int]:
        """(group, peer) -> the largest bucket in bytes, where the sum is an exchange with that peer (else empty)."""
        if self.peer is None or not self.buckets:
            return {}
        return {(self.group, self.peer): max(sum(p.numel() * p.element_size() for p in b) for b in self.buckets)}

    def prepost(self) -> None:
        """Post the receives of the peer's buckets (exchange mode only; once per step, before :meth:`start`)."""
        if self.peer is None or self._incoming:
            return
        for bucket in self.buckets:
            buf = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            (work,) = self.comm.post([Op(False, buf, self.peer, self.group)])
            self._incoming.append((buf, work))

    def start(self) -> None:
        """Launch the sum of every bucket (non-blocking)."""
        self.prepost()
        for i, bucket in enumerate(self.buckets):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = _flatten_dense_tensors(grads)
            if self.peer is None:
                flat, work = self.comm.allreduce_async(flat, self.group)
                self._pending.append((bucket, flat, [work], None))
            else:
                buf, recv = self._incoming[i]
                (send,) = self.comm.post([Op(True, flat, self.peer, self.group)])
                self._pending.append((bucket, flat, [recv, send], buf))
        self._incoming.clear()

    def held(self) -> list[torch.Tensor]:
        """Buffers of the sum in progress: the peer's buckets posted early and the flat copies being summed."""
        return [buf for buf, _ in self._incoming] + [t for _, flat, _, peer in self._pending
                                                     for t in (flat, peer) if t is not None]

    def wait(self, what: str | Callable[[], str]) -> None:
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

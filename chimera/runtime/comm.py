"""The one communication layer: process groups, p2p batches, timed waits (gradient buckets: ``grad_sync``).

Process groups (created in the same order on every rank):

* one p2p group per pipe, so messages of the down and up pipes between the same two workers can never be
  confused (NCCL matches p2p messages per communicator in posting order);
* one group per stage with more than one replica (``Schedule.stage_group``: both Chimera replicas over
  all W data-parallel groups) for the gradient allreduce, and with the optimizer state sharded (ZeRO-1) for the
  broadcast of each parameter from the rank that stepped it (:meth:`Communicator.broadcast_async`);
* for a stage whose gradients are offloaded (``host_stages``), a second group over the same ranks on gloo
  (:attr:`Communicator.host_groups`): its gradients are summed over host buffers, which NCCL cannot reduce, while
  its device traffic stays on the groups above. Built on CPU too (where every group is gloo), so the two-group
  path runs in the CPU tests;
* one group per set of ranks holding the ends of a tied pair on different stages (e.g. the first and the last
  stage), when the model ties weights;
* the default group (all ranks) for the global gradient norm.

:class:`~chimera.runtime.batches.CommBatches` (`batches.py`) posts a worker's communication batches (runs of send/receive actions of the schedule)
and keeps their handles. Every wait has a deadline; a stall raises :class:`StallError` naming the worker,
the action and the micro-batch.

Payload modes: ``full`` (training) or ``single-byte`` (profiling compute alone): every p2p message and
every allreduce carries one byte; a receiver zero-fills its buffer and allreduced tensors keep their local
values, so results of such a run are not training results. The communicator counts the bytes of every
message and allreduce it sends (:meth:`Communicator.payload_sizes`) and the operations posted on each group
(:meth:`Communicator.group_ops`: ``pipe down``, ``stage 1``, ``host 0``, ``tied``, ``all``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from chimera.schedule import Schedule
from chimera.util.shm import SPIN_S, ShmChannels, ShmWork


class StallError(RuntimeError):
    """A blocking wait ran past the timeout."""


PAYLOADS = ("full", "single-byte")


class Op(NamedTuple):
    """One point-to-point operation: send ``tensor`` to, or receive it from, global rank ``peer`` in ``group``."""

    is_send: bool
    tensor: torch.Tensor
    peer: int
    group: Any


class Communicator:
    """Process groups and timed waits for one rank of a pipeline job."""

    def __init__(self, schedule: Schedule, rank: int, tied: Iterable[Sequence[int]] = (), timeout_s: float = 120.0,
                 worker_name: str = "", payload: str = "full", host_stages: Collection[int] = (),
                 p2p: str = "auto", message_bytes: int = 0, spin_s: float = SPIN_S) -> None:
        if payload not in PAYLOADS:
            raise ValueError(f"payload must be one of {PAYLOADS}, got {payload!r}")
        self.single_byte = payload == "single-byte"
        self._sizes: Counter[int] = Counter()
        self._ops: Counter[str] = Counter()
        self._labels: dict[int, str] = {id(None): "all"}  # id of a group -> its name in group_ops()
        self.schedule = schedule
        self.rank = rank
        self.timeout_s = timeout_s
        self.name = worker_name or f"worker {rank}"
        self.backend = dist.get_backend()
        # gloo posts each op independently; NCCL orders a communicator's ops on one stream
        self.prefetch_recvs = self.backend == "gloo"
        self._group_peer: dict[tuple[int, int], int] = {}  # (group, global rank) -> the rank within the group
        world = dist.get_world_size()
        self.pipe_groups = {pipe: self._named(dist.new_group(list(range(world))), f"pipe {pipe}")
                            for pipe in schedule.pipes}
        self.stage_groups: dict[int, dist.ProcessGroup] = {}
        self.host_groups: dict[int, dist.ProcessGroup] = {}  # stage -> gloo group for its gradient sums on the host
        for s in range(schedule.stages):
            ranks = schedule.stage_group(s)
            if len(ranks) > 1:  # every rank creates every group, in the same order
                group = dist.new_group(ranks)
                host = dist.new_group(ranks, backend="gloo") if s in host_stages else None
                if rank in ranks:
                    self.stage_groups[s] = self._named(group, f"stage {s}")
                    if host is not None:
                        self.host_groups[s] = self._named(host, f"host {s}")
        self._host_ids = {id(g) for g in self.host_groups.values()}
        self.tied_groups: dict[tuple[int, ...], Any] = {}  # ranks holding an end of a tied pair -> their group
        for ranks in sorted({tuple(sorted(r)) for r in tied if len(r) > 1}):  # every rank, in the same order
            group = dist.new_group(list(ranks))
            if rank in ranks:
                self.tied_groups[ranks] = self._named(group, "tied")
        # same-host p2p through shared memory (gloo jobs with p2p "auto"; a collective: every rank, same arguments),
        # each channel taking the job's largest activation (``message_bytes``)
        pairs = _pairs(schedule, world)
        self.shm = (ShmChannels.open(rank, pairs, p2p == "auto", dict.fromkeys(pairs, message_bytes), spin_s)
                    if self.backend == "gloo" else None)

    def open_sums(self, messages: Mapping[tuple[Any, int], int]) -> None:
        """Shared-memory channels for the pairwise gradient sums of this rank: ``messages`` maps (group, peer's
        global rank) to the largest message exchanged with that peer on that group. A collective: every rank
        calls it once, after building its sums (no channels on NCCL or with another p2p)."""
        if self.shm is None:
            return
        sizes = {}
        for (group, peer), nbytes in messages.items():
            label = self._labels.get(id(group), "")
            sizes[(label, self.rank, peer)] = sizes[(label, peer, self.rank)] = nbytes
        self.shm.add(sorted(sizes), sizes)

    def close(self) -> None:
        """Unmap the shared-memory channels."""
        if self.shm is not None:
            self.shm.close()

    def _named(self, group: Any, label: str) -> Any:
        self._labels[id(group)] = label
        return group

    def grad_group(self, stage: int, on_host: bool) -> dist.ProcessGroup | None:
        """The group that sums ``stage``'s gradients: its host group when they are summed over host buffers
        (offloaded), else its device group; None where this rank holds no replicated copy of the stage."""
        return (self.host_groups if on_host else self.stage_groups).get(stage)

    def posts_early(self, group: Any) -> bool:
        """Whether receives on ``group`` may be posted ahead of their sends: on gloo (every host group), which
        posts each op independently; not on NCCL, which orders a communicator's ops on one stream."""
        return self.prefetch_recvs or id(group) in self._host_ids

    def _count(self, t: torch.Tensor, group: Any) -> None:
        """Count one operation on ``group``; a host tensor on a device (NCCL) group is refused here, by name."""
        label = self._labels.get(id(group), "other")
        if t.device.type == "cpu" and self.backend != "gloo" and id(group) not in self._host_ids:
            raise RuntimeError(f"{self.name}: a host tensor posted on the {self.backend} group '{label}', which reduces "
                               "device tensors only; host sums go on a host group (Communicator.host_groups)")
        self._ops[label] += 1

    def global_rank(self, worker: int) -> int:
        """Global rank of ``worker`` in this rank's data-parallel group."""
        return (self.rank // self.schedule.workers) * self.schedule.workers + worker

    def start_step(self) -> None:
        """Reset the per-step payload and operation counters."""
        self._sizes.clear()
        self._ops.clear()

    def group_ops(self) -> dict[str, int]:
        """Group name -> operations this rank posted on it in the current step (a p2p op, an allreduce)."""
        return dict(self._ops)

    def payload_sizes(self) -> dict[int, int]:
        """Bytes per message or allreduce sent by this rank in the current step -> count."""
        return dict(self._sizes)

    def _payload(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.uint8, device=t.device) if self.single_byte else t

    def post(self, ops: Sequence[Op]) -> list[dist.Work]:
        """Post ``ops`` at once (one ``batch_isend_irecv`` per process group); returns their works in order.

        In single-byte mode a receive's buffer is zero-filled and one byte travels instead.
        """
        if self.single_byte:
            for op in ops:
                if not op.is_send:
                    op.tensor.zero_()
            ops = [op._replace(tensor=self._payload(op.tensor)) for op in ops]
        for op in ops:
            self._count(op.tensor, op.group)
            if op.is_send:
                self._sizes[op.tensor.numel() * op.tensor.element_size()] += 1
        if self.backend == "gloo":  # gloo posts every op on its own: straight to the group, no per-op checks
            return [self._post_one(op) for op in ops]
        works: list[dist.Work] = [None] * len(ops)  # type: ignore[list-item]
        by_group: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            by_group.setdefault(id(op.group), []).append(i)
        for idx in by_group.values():
            if len(idx) == 1:  # one op: no batch to coalesce
                op = ops[idx[0]]
                works[idx[0]] = (dist.isend if op.is_send else dist.irecv)(op.tensor, op.peer, group=op.group)
                continue
            p2p = [dist.P2POp(dist.isend if ops[i].is_send else dist.irecv, ops[i].tensor, ops[i].peer, ops[i].group)
                   for i in idx]
            for i, w in zip(idx, dist.batch_isend_irecv(p2p)):
                works[i] = w
        return works

    def sender(self, peer: int, group: Any) -> Callable[[torch.Tensor], dist.Work]:
        """A send of one tensor to global rank ``peer`` on ``group``, posted at once and counted as :meth:`post` posts
        and counts it, with its route resolved now (its shared-memory channel, the peer's rank in the group): the
        call a communication batch makes for each send, where gloo posts every op on its own (elsewhere, and in
        single-byte mode, :meth:`post` itself)."""
        if self.backend != "gloo" or self.single_byte:
            return lambda t: self.post([Op(True, t, peer, group)])[0]
        label, ops, sizes = self._labels.get(id(group), "other"), self._ops, self._sizes
        shm = self.shm.sender(self._labels.get(id(group), ""), peer) if self.shm is not None else None
        g = group if group is not None else dist.group.WORLD
        to = self._group_rank(g, peer)

        def send(t: torch.Tensor) -> dist.Work:
            nbytes = t.numel() * t.element_size()
            ops[label] += 1
            sizes[nbytes] += 1
            work = shm(t, nbytes) if shm is not None else None
            return work if work is not None else g.send([t], to, 0)

        return send

    def _post_one(self, op: Op) -> dist.Work:
        """``op`` posted on its group's ``send``/``recv`` (what ``dist.isend``/``irecv`` end in, tag 0), the peer's
        rank in the group resolved once."""
        group = op.group if op.group is not None else dist.group.WORLD
        if self.shm is not None:
            work = self.shm.post(self._labels.get(id(op.group), ""), op.peer, op.is_send, op.tensor)
            if work is not None:
                return work
        return (group.send if op.is_send else group.recv)([op.tensor], self._group_rank(group, op.peer), 0)

    def _group_rank(self, group: Any, peer: int) -> int:
        """Global rank ``peer``'s rank within ``group``, looked up once per pair."""
        key = (id(group), peer)
        rank = self._group_peer.get(key)
        if rank is None:
            rank = self._group_peer[key] = dist.get_group_rank(group, peer)
        return rank

    def allreduce_async(self, t: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, dist.Work]:
        """Start a SUM allreduce of ``t`` (one byte in single-byte mode); returns (result tensor, work)."""
        buf = self._payload(t)
        self._count(buf, group)
        self._sizes[buf.numel() * buf.element_size()] += 1
        return t, dist.all_reduce(buf, group=group, async_op=True)

    def broadcast_async(self, t: torch.Tensor, src: int, group: dist.ProcessGroup) -> dist.Work:
        """Start a broadcast of ``t`` from global rank ``src`` over ``group`` into ``t`` on the others (one byte in
        single-byte mode: the receivers keep their values); wait for it with :meth:`wait`."""
        buf = self._payload(t)
        self._count(buf, group)
        if src == self.rank:
            self._sizes[buf.numel() * buf.element_size()] += 1
        return dist.broadcast(buf, src, group=group, async_op=True)

    def allreduce(self, t: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> torch.Tensor:
        """SUM-allreduce ``t`` in place with the timeout; returns ``t``."""
        t, work = self.allreduce_async(t, group)
        self.wait(work, what)
        return t

    def wait(self, work: dist.Work, what: str | Callable[[], str]) -> None:
        """Wait for ``work`` at most ``timeout_s``; raise :class:`StallError` describing ``what`` (a callable: made
        only then, so that the hot path builds no string)."""
        if work is None:
            return
        try:
            if self.backend == "gloo":
                if self.shm is not None and not isinstance(work, ShmWork):
                    with self.shm.background():  # shared-memory receives keep filling while this blocks
                        work.wait(timedelta(seconds=self.timeout_s))
                    return
                work.wait(timedelta(seconds=self.timeout_s))
                return
            deadline = time.monotonic() + self.timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise StallError("timeout")
                time.sleep(0.0005)
            work.wait()
        except (RuntimeError, StallError) as e:
            what = what() if callable(what) else what
            raise StallError(f"{self.name} stalled: {what} did not complete within {self.timeout_s:g} s "
                             f"(--timeout); the peer is slow, dead or waiting elsewhere [{str(e).splitlines()[0][:200]}]"
                             ) from None




def _pairs(schedule: Schedule, world: int) -> list[tuple[str, int, int]]:
    """(pipe group label, sending rank, receiving rank) of every p2p channel of a job: both directions between the
    workers of adjacent stages of each pipe, in every data-parallel group."""
    d = schedule.workers
    out = set()
    for (pipe, stage), w in schedule.placement.items():
        nxt = schedule.placement.get((pipe, stage + 1))
        if nxt is None or nxt == w:
            continue
        for g in range(world // d):
            out |= {(f"pipe {pipe}", g * d + w, g * d + nxt), (f"pipe {pipe}", g * d + nxt, g * d + w)}
    return sorted(out)

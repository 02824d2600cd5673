"""Point-to-point messages through shared memory between worker processes on one host (CPU, gloo jobs).

A message between two processes on one host through gloo crosses the loopback TCP stack and two thread wake-ups
on the receiving side (gloo's transport thread, then the waiting one): ~0.06–0.09 ms one way on the development
machine, while the sender's call that writes it costs it 0.06–0.18 ms. A channel here is a ring buffer in a
shared-memory mapping, one per direction between two ranks that exchange activations or gradients on a pipe: the
sender copies the tensor's bytes in (``memmove`` from its address: contiguous CPU tensors only) and wakes the
receiver's futex; the receiver copies them out. One way costs ~0.04 ms to a sleeping receiver, ~0.005 ms to one
that polls.

Rules (the same as gloo's for one channel): the n-th receive posted on a channel gets the n-th message sent on it,
whatever order the works are waited in; a send never blocks (when the ring is full a background thread writes it
as room frees); while the rank blocks on a gloo wait, that thread also fills its posted receives; every wait has a
deadline, and a peer that exits is noticed within a second.
A waiting receive first polls its channel for up to ``spin_s`` (:data:`SPIN_S`), yielding its core to any other
runnable thread between polls, and only then sleeps on the futex: a sleeping receiver's wake-up costs ~0.06 ms on
the development machine's virtual machine (a halted core woken by an interrupt), and its sender's wake call more.
A channel takes messages up to ``MAX_MESSAGE_BYTES`` unless it was opened for larger ones (a pair of replicas'
gradient buckets, an activation larger than that): its ring then holds two of its largest message. The creator
writes the limit into the channel's header, so both sides route by one figure: a larger message takes gloo.
Large rings are capped (:data:`MAX_CHANNEL_BYTES`, and a quarter of /dev/shm's free space shared by the host's ranks).

Linux on x86-64 only (futexes on a shared mapping, x86's store order: a reader that sees the ring's head sees the
data written before it); elsewhere, or where a rank cannot map its peer's file (another host, another /dev/shm),
the channel is gloo's. The channels are set up by one collective over the default group (:meth:`ShmChannels.open`),
and their files are unlinked once both ends have them mapped.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chimera.util.cores import host_id
from chimera.util.shm_ring import (
    FUTEX_WAIT,
    LIVENESS_S,
    MAX_CHANNEL_BYTES,
    MAX_MESSAGE_BYTES,
    POLL_S,
    RING_BYTES,
    Channel,
    alive,
    futex,
    ring_bytes,
    supported,
)

__all__ = ["MAX_CHANNEL_BYTES", "MAX_MESSAGE_BYTES", "RING_BYTES", "SPIN_S", "ShmChannels", "ShmWork", "ring_bytes",
           "supported"]

#: how long a waiting receive polls before it sleeps, unless its channels were opened with another figure (the
#: runtime's ``--p2p-spin``)
SPIN_S = 0.01


def _limits(mine: Iterable[tuple[str, int, int]], sizes: Mapping[tuple[str, int, int], int], sharing: int = 1
            ) -> dict[tuple[str, int, int], int]:
    """The message limit of each channel this rank creates: its size asked where the ring fits under
    ``MAX_CHANNEL_BYTES`` and, with the others before it, this rank's share of a quarter of /dev/shm's free space
    (``sharing``: the ranks of this host, which make theirs at the same time); else the default."""
    try:
        st = os.statvfs("/dev/shm")
        room = st.f_bavail * st.f_frsize // (4 * max(1, sharing))
    except OSError:
        room = 0
    out = {}
    for key in mine:
        want = max(sizes.get(key, MAX_MESSAGE_BYTES), MAX_MESSAGE_BYTES)
        ring = ring_bytes(want)
        if want > MAX_MESSAGE_BYTES and (ring > MAX_CHANNEL_BYTES or ring > room):
            want, ring = MAX_MESSAGE_BYTES, RING_BYTES
        room -= ring if want > MAX_MESSAGE_BYTES else 0
        out[key] = want
    return out


class ShmWork:
    """A posted send or receive on a :class:`Channel`, waited for like a ``dist.Work``."""

    __slots__ = ("owner", "channel", "is_send", "nbytes", "tensor", "done", "peer_pid")

    def __init__(self, owner: ShmChannels, channel: Channel, is_send: bool, tensor: torch.Tensor, nbytes: int
                 ) -> None:
        self.owner, self.channel, self.is_send = owner, channel, is_send
        self.tensor = tensor  # contiguous, on the CPU: copied by address
        self.nbytes = nbytes
        self.done = False
        self.peer_pid = int(channel.pids[1 if is_send else 0])

    def is_completed(self) -> bool:
        """Whether the message is written (a send) or read (a receive), moving the channel on where it can."""
        if not self.done:
            self.owner.progress(self.channel)
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done; RuntimeError after ``timeout`` or when the peer process has exited."""
        if not self.done:
            limit = timeout.total_seconds() if timeout is not None else 1e9
            self.owner.wait_for(self, time.monotonic() + limit, limit)
        return True


class ShmChannels:
    """The shared-memory channels of one rank, keyed by (group label, sending rank, receiving rank)."""

    def __init__(self, rank: int, channels: dict[tuple[str, int, int], Channel], enabled: bool = False,
                 spin_s: float = SPIN_S) -> None:
        self.rank = rank
        self.channels = channels
        self.spin_s = spin_s  # a waiting receive polls this long before it sleeps on the futex
        self._flusher: threading.Thread | None = None
        self._armed = False  # the caller blocks elsewhere: the background thread reads too (background())
        self._closed = False
        self.enabled = enabled  # whether add() opens channels

    @classmethod
    def open(cls, rank: int, pairs: Iterable[tuple[str, int, int]], enabled: bool,
             sizes: Mapping[tuple[str, int, int], int] | None = None, spin_s: float = SPIN_S) -> ShmChannels:
        """Set up the channels of ``pairs`` (label, sender, receiver) whose two ranks share a host: a collective
        over the default group that every rank calls with the same ``enabled`` (no channels when it is False) and
        the pairs it sends or receives on (:meth:`add`). ``spin_s``: how long a waiting receive polls before it
        sleeps (module docstring)."""
        chans = cls(rank, {}, enabled, spin_s)
        chans.add(pairs, sizes)
        return chans

    def add(self, pairs: Iterable[tuple[str, int, int]], sizes: Mapping[tuple[str, int, int], int] | None = None
            ) -> None:
        """Open more channels: a collective over the default group, as :meth:`open` (nothing where not enabled).
        ``sizes``: the largest message of a pair where it exceeds ``MAX_MESSAGE_BYTES`` (the sender's figure
        counts, capped by :func:`_limits`)."""
        if not self.enabled:
            return
        rank, world, ok = self.rank, dist.get_world_size(), supported()
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, (host_id() if ok else None, secrets.token_hex(6)))
        token = hosts[0][1]
        local = [p for p in pairs if ok and hosts[p[1]][0] is not None and hosts[p[1]][0] == hosts[p[2]][0]
                 and p not in self.channels]
        mine: dict[tuple[str, int, int], Channel] = {}
        opened: dict[tuple[str, int, int], Channel] = {}
        here = sum(h[0] is not None and h[0] == hosts[rank][0] for h in hosts)  # ranks on this host
        limits = _limits([k for k in local if k[1] == rank], sizes or {}, here)
        try:
            for key in local:
                if key[1] == rank:
                    with contextlib.suppress(OSError):
                        ch = mine[key] = Channel(_path(token, key), create=True, max_message=limits[key])
                        ch.pids[0] = os.getpid()
            dist.barrier()
            for key in local:
                if key[2] == rank and key[1] != rank:
                    with contextlib.suppress(OSError, ValueError):
                        ch = opened[key] = Channel(_path(token, key), create=False)
                        ch.pids[1] = os.getpid()
            both: list[Any] = [None] * world
            dist.all_gather_object(both, sorted(opened))
        finally:
            for ch in mine.values():
                with contextlib.suppress(OSError):
                    os.unlink(ch.path)
        agreed = {tuple(k) for keys in both for k in keys}
        for k, ch in {**mine, **opened}.items():
            if k in agreed:
                self.channels[k] = ch
            else:
                ch.close()

    def post(self, label: str, peer: int, is_send: bool, tensor: torch.Tensor) -> ShmWork | None:
        """Post one send to (receive from) global rank ``peer`` on the group ``label``; None where the message
        takes gloo (no channel, larger than the channel takes, or not a contiguous CPU tensor)."""
        key = (label, self.rank, peer) if is_send else (label, peer, self.rank)
        ch = self.channels.get(key)
        if ch is None:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        if not _fits(ch, tensor, nbytes):
            return None
        if is_send:
            return self._send(ch, tensor, nbytes)
        w = ShmWork(self, ch, False, tensor, nbytes)
        ch.posted.append(w)
        return w

    def sender(self, label: str, peer: int) -> Callable[[torch.Tensor, int], ShmWork | None] | None:
        """``post`` of a send to ``peer`` on ``label`` with its channel found now: a call of (tensor, its bytes) for a
        hot path; None where the pair has no channel (the call itself returns None where the message takes gloo)."""
        ch = self.channels.get((label, self.rank, peer))
        if ch is None:
            return None

        def send(tensor: torch.Tensor, nbytes: int) -> ShmWork | None:
            return self._send(ch, tensor, nbytes) if _fits(ch, tensor, nbytes) else None

        return send

    def _send(self, ch: Channel, tensor: torch.Tensor, nbytes: int) -> ShmWork:
        """Write the message now where its ring has room and nothing is queued before it; else queue it for the
        background thread."""
        w = ShmWork(self, ch, True, tensor, nbytes)
        with ch.lock:
            if ch.pending or not ch.try_write(tensor, nbytes):
                ch.pending.append(w)
                self._start_flusher()
            else:
                w.done = True
        return w

    def progress(self, ch: Channel) -> None:
        """Write what ``ch`` has pending and read what has arrived for its posted receives (never blocks)."""
        with ch.lock:
            if ch.pending:
                ch.flush()
            while ch.posted:
                w = ch.posted[0]
                if not ch.try_read(w.tensor, w.nbytes):
                    break
                ch.posted.popleft()
                w.done = True

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """While the caller blocks on something else (a gloo collective or message): the background thread also
        reads what arrives for the posted receives, as gloo's transport thread fills a posted receive, so that a
        peer whose sends wait for room in a ring is not held up by this rank's wait (nothing when no receive is
        posted and no send pending)."""
        chans = list(self.channels.values())
        if not any(ch.posted or ch.pending for ch in chans):
            yield
            return
        with self._all_locks():  # against the thread's exit check
            self._armed = True
            self._start_flusher()
        try:
            yield
        finally:
            self._armed = False

    def wait_for(self, w: ShmWork, deadline: float, limit: float) -> None:
        """Block until ``w`` is done (earlier receives on its channel are filled on the way)."""
        ch = w.channel
        checked = time.monotonic()
        while True:
            self._flush_all()
            p = ch.pub.value
            self.progress(ch)
            if w.done:
                return
            now = time.monotonic()
            if now >= deadline:
                raise RuntimeError(f"{'send to' if w.is_send else 'receive from'} process {w.peer_pid} timed out "
                                   f"after {limit:g} s (shared memory)")
            if now - checked >= LIVENESS_S:
                checked = now
                if w.peer_pid and not alive(w.peer_pid):
                    raise RuntimeError(f"the peer process {w.peer_pid} exited (shared memory)")
            slice_s = min(deadline - now, LIVENESS_S)
            if w.is_send or self._any_pending():
                time.sleep(min(slice_s, POLL_S))  # room in a ring wakes no one: poll
            elif not (self.spin_s and _spin(ch, p, min(self.spin_s, slice_s))):
                futex(ch.pub_ptr, FUTEX_WAIT, p, slice_s)

    def _any_pending(self) -> bool:
        return any(ch.pending for ch in self.channels.values())

    def _start_flusher(self) -> None:
        """Write the pending sends from a thread as their rings make room, whatever the main thread waits on (a
        gradient sum, a gloo message): gloo's sends complete in the background too, and a schedule may rely on it."""
        if self._flusher is None or not self._flusher.is_alive():
            self._flusher = threading.Thread(target=self._flush_loop, name="chimera-shm-flush", daemon=True)
            self._flusher.start()

    def _idle(self) -> bool:
        """Nothing for the background thread: no send pending, and no receive posted while armed."""
        return not self._any_pending() and not (self._armed and any(ch.posted for ch in self.channels.values()))

    @contextlib.contextmanager
    def _all_locks(self) -> Iterator[None]:
        chans = list(self.channels.values())
        for ch in chans:
            ch.lock.acquire()
        try:
            yield
        finally:
            for ch in chans:
                ch.lock.release()

    def _flush_loop(self) -> None:
        """The background thread: pending sends written as rings make room; while armed (:meth:`background`),
        posted receives filled as messages arrive."""
        while not self._closed:
            self._flush_all()
            waiting = None
            if self._armed:
                for ch in self.channels.values():
                    if ch.posted:
                        self.progress(ch)
                        waiting = waiting or (ch if ch.posted else None)
            if self._idle():  # done, unless re-armed or a send went pending since (both hold the locks)
                with self._all_locks():
                    if self._idle():
                        self._flusher = None
                        return
            if waiting is not None and not self._any_pending():
                futex(waiting.pub_ptr, FUTEX_WAIT, waiting.pub.value, POLL_S)  # woken by its next message
            else:
                time.sleep(POLL_S)

    def _flush_all(self) -> None:
        for ch in self.channels.values():
            if ch.pending:
                ch.flush()

    def close(self) -> None:
        """Stop the flusher; unmap every channel."""
        self._closed = True
        if self._flusher is not None:
            self._flusher.join(timeout=1.0)
        for ch in self.channels.values():
            ch.close()
        self.channels.clear()


def _fits(ch: Channel, tensor: torch.Tensor, nbytes: int) -> bool:
    """Whether ``ch`` takes ``tensor`` (``nbytes`` bytes): within its message limit, contiguous, on the CPU (it is
    copied by address); else the message takes gloo."""
    return nbytes <= ch.max_message and tensor.is_contiguous() and tensor.is_cpu


def _spin(ch: Channel, p: int, seconds: float) -> bool:
    """Poll ``ch``'s futex word for up to ``seconds``, yielding the core between polls; whether it moved from ``p``
    (a message arrived)."""
    pub, now, pass_core = ch.pub, time.perf_counter, os.sched_yield
    end = now() + seconds
    while pub.value == p:
        if now() >= end:
            return False
        pass_core()
    return True


def _path(token: str, key: tuple[str, int, int]) -> str:
    label = "".join(c if c.isalnum() else "_" for c in key[0])
    return f"/dev/shm/chimera-{token}-{label}-{key[1]}-{key[2]}"

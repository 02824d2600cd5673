"""Point-to-point messages through shared memory between worker processes on one host (CPU, gloo jobs).

A message between two processes on one host through gloo crosses the loopback TCP stack and two thread wake-ups
on the receiving side (gloo's transport thread, then the waiting one): ~0.06–0.09 ms one way on the development
machine, while the sender's call that writes it costs it 0.06–0.18 ms. A channel here is a ring buffer in a
shared-memory mapping, one per direction between two ranks that exchange activations or gradients on a pipe: the
sender copies the tensor in and wakes the receiver's futex; the receiver copies it out. One way costs ~0.02 ms.

Rules (the same as gloo's for one channel): the n-th receive posted on a channel gets the n-th message sent on it,
whatever order the works are waited in; a send never blocks (when the ring is full a background thread writes it
as room frees); while the rank blocks on a gloo wait, that thread also fills its posted receives; every wait has a
deadline, and a peer that exits is noticed within a second.
Messages above ``MAX_MESSAGE_BYTES`` take gloo (both sides route by the tensor's size, so they agree).

Linux on x86-64 only (futexes on a shared mapping, x86's store order: a reader that sees the ring's head sees the
data written before it); elsewhere, or where a rank cannot map its peer's file (another host, another /dev/shm),
the channel is gloo's. The channels are set up by one collective over the default group (:meth:`ShmChannels.open`),
and their files are unlinked once both ends have them mapped.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: messages up to this size go through shared memory, larger ones through gloo
MAX_MESSAGE_BYTES = 256 * 1024
#: ring bytes per channel (a multiple of 64; at least 64 + MAX_MESSAGE_BYTES + 64)
RING_BYTES = 1024 * 1024
_DATA = 256  # header: futex word @0, head @64, tail @128, sender pid @192, receiver pid @200
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1
_LIVENESS_S = 1.0  # a waiter checks that its peer process is alive this often
_POLL_S = 0.0005  # how often a full ring is retried (room freed wakes no one)


def supported() -> bool:
    """Whether this platform has the transport (Linux, x86-64, /dev/shm)."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc: Any = None


def _futex(addr: int, op: int, val: int, timeout_s: float | None = None) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    ts = None
    if timeout_s is not None:
        ts = ctypes.byref(_Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9)))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), op, ctypes.c_int(val), ts, None, 0)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited one not yet reaped, a zombie, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


class Channel:
    """One direction between two ranks: a ring of messages (8-byte size header, data, 64-byte aligned)."""

    def __init__(self, path: str, create: bool) -> None:
        size = _DATA + RING_BYTES
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:  # the pages reserved now: a full /dev/shm fails here (gloo's then), not with SIGBUS later
                os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path = path
        self.pub = ctypes.c_int32.from_buffer(self.mm, 0)  # bumped per message: the receiver's futex word
        self.head = ctypes.c_uint64.from_buffer(self.mm, 64)  # bytes written (the sender's)
        self.tail = ctypes.c_uint64.from_buffer(self.mm, 128)  # bytes consumed (the receiver's)
        self.pids = (ctypes.c_int64 * 2).from_buffer(self.mm, 192)  # sender, receiver
        self.words = (ctypes.c_int64 * (RING_BYTES // 8)).from_buffer(self.mm, _DATA)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=_DATA, count=RING_BYTES)
        self.pub_addr = ctypes.addressof(self.pub)
        self.lock = threading.RLock()  # the main thread and the background thread move the channel on
        self.pending: deque[ShmWork] = deque()  # sends not yet written (ring full), in order
        self.posted: deque[ShmWork] = deque()  # receives posted, not yet filled, in order

    # -- sender ------------------------------------------------------------------------------------
    def try_write(self, src: torch.Tensor) -> bool:
        """Write ``src`` (bytes) if the ring has room; False if not (nothing written)."""
        n = src.numel()
        need = 64 + -(-n // 64) * 64
        head, tail = self.head.value, self.tail.value
        pos = head % RING_BYTES
        skip = 0
        if head == tail and 0 < need <= pos or RING_BYTES - pos < need:  # empty: start over (few pages touched);
            skip = RING_BYTES - pos  # or wrap (a message never straddles the end; need <= RING_BYTES / 2)
        if RING_BYTES - (head - tail) < skip + need:
            return False
        if skip:
            self.words[pos // 8] = -1
            pos = 0
        self.words[pos // 8] = n
        if n:
            self.data[pos + 64:pos + 64 + n].copy_(src)
        self.head.value = head + skip + need  # after the data: x86 keeps the order of stores
        self.pub.value = (self.pub.value + 1) & 0x7FFFFFFF
        _futex(self.pub_addr, _FUTEX_WAKE, 1)  # a syscall: the reader either sees pub moved or is woken
        return True

    def flush(self) -> None:
        """Write the pending sends that now fit, in order."""
        with self.lock:
            while self.pending and self.try_write(self.pending[0].src):
                w = self.pending.popleft()
                w.done, w.src = True, None

    # -- receiver ----------------------------------------------------------------------------------
    def try_read(self, dst: torch.Tensor | None, nbytes: int) -> bool:
        """Read the next message into ``dst`` (bytes) if there is one; False if the ring is empty."""
        while True:
            tail = self.tail.value
            if self.head.value == tail:
                return False
            pos = tail % RING_BYTES
            n = self.words[pos // 8]
            if n >= 0:
                break
            self.tail.value = tail + RING_BYTES - pos  # the sender wrapped
        if n != nbytes:
            raise RuntimeError(f"shared-memory channel {self.path}: the next message has {n} bytes, the receive "
                               f"posted for it {nbytes}: the two ranks' schedules disagree")
        if n and dst is not None:
            dst.copy_(self.data[pos + 64:pos + 64 + n])
        self.tail.value = tail + 64 + -(-n // 64) * 64
        return True

    def close(self) -> None:
        self.pending.clear()
        self.posted.clear()
        del self.pub, self.head, self.tail, self.pids, self.words, self.data
        with contextlib.suppress(BufferError):
            self.mm.close()


class ShmWork:
    """A posted send or receive on a :class:`Channel`, waited for like a ``dist.Work``."""

    __slots__ = ("owner", "channel", "is_send", "src", "dst", "nbytes", "tensor", "done", "peer_pid")

    def __init__(self, owner: ShmChannels, channel: Channel, is_send: bool, tensor: torch.Tensor) -> None:
        self.owner, self.channel, self.is_send, self.tensor = owner, channel, is_send, tensor
        flat = tensor.reshape(-1).view(torch.uint8)
        self.src = flat if is_send else None
        self.dst = None if is_send else flat
        self.nbytes = flat.numel()
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

    def __init__(self, rank: int, channels: dict[tuple[str, int, int], Channel]) -> None:
        self.rank = rank
        self.channels = channels
        self._flusher: threading.Thread | None = None
        self._armed = False  # the caller blocks elsewhere: the background thread reads too (background())
        self._closed = False

    @classmethod
    def open(cls, rank: int, pairs: Iterable[tuple[str, int, int]], enabled: bool) -> ShmChannels:
        """Set up the channels of ``pairs`` (label, sender, receiver) whose two ranks share a host: a collective
        over the default group that every rank calls with the same pairs and ``enabled`` (none when it is False)."""
        if not enabled:
            return cls(rank, {})
        world = dist.get_world_size()
        ok = supported()
        host = _host_id() if ok else None
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, (host, secrets.token_hex(6)))
        token = hosts[0][1]
        local = [p for p in pairs if ok and hosts[p[1]][0] is not None and hosts[p[1]][0] == hosts[p[2]][0]]
        mine: dict[tuple[str, int, int], Channel] = {}
        opened: dict[tuple[str, int, int], Channel] = {}
        try:
            for key in local:
                if key[1] == rank:
                    with contextlib.suppress(OSError):
                        ch = mine[key] = Channel(_path(token, key), create=True)
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
        channels = {k: ch for k, ch in {**mine, **opened}.items() if k in agreed}
        for k, ch in {**mine, **opened}.items():
            if k not in agreed:
                ch.close()
        return cls(rank, channels)

    def post(self, label: str, peer: int, is_send: bool, tensor: torch.Tensor) -> ShmWork | None:
        """Post one send to (receive from) global rank ``peer`` on the group ``label``; None where the message
        takes gloo (no channel, or larger than ``MAX_MESSAGE_BYTES``)."""
        key = (label, self.rank, peer) if is_send else (label, peer, self.rank)
        ch = self.channels.get(key)
        if ch is None or tensor.numel() * tensor.element_size() > MAX_MESSAGE_BYTES or not tensor.is_contiguous():
            return None
        w = ShmWork(self, ch, is_send, tensor)
        if is_send:
            with ch.lock:
                if ch.pending or not ch.try_write(w.src):  # type: ignore[arg-type]
                    ch.pending.append(w)
                    self._start_flusher()
                else:
                    w.done, w.src = True, None
        else:
            ch.posted.append(w)
        return w

    def progress(self, ch: Channel) -> None:
        """Write what ``ch`` has pending and read what has arrived for its posted receives (never blocks)."""
        with ch.lock:
            if ch.pending:
                ch.flush()
            while ch.posted:
                w = ch.posted[0]
                if not ch.try_read(w.dst, w.nbytes):
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
            if now - checked >= _LIVENESS_S:
                checked = now
                if w.peer_pid and not _alive(w.peer_pid):
                    raise RuntimeError(f"the peer process {w.peer_pid} exited (shared memory)")
            slice_s = min(deadline - now, _LIVENESS_S)
            if w.is_send or self._any_pending():
                time.sleep(min(slice_s, _POLL_S))  # room in a ring wakes no one: poll
            else:
                _futex(ch.pub_addr, _FUTEX_WAIT, p, slice_s)

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
                _futex(waiting.pub_addr, _FUTEX_WAIT, waiting.pub.value, _POLL_S)  # woken by its next message
            else:
                time.sleep(_POLL_S)

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


def _host_id() -> str:
    """This host's identity: name and boot id (two hosts may share a name, not a boot)."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{socket.gethostname()}|{boot}"


def _path(token: str, key: tuple[str, int, int]) -> str:
    label = "".join(c if c.isalnum() else "_" for c in key[0])
    return f"/dev/shm/chimera-{token}-{label}-{key[1]}-{key[2]}"

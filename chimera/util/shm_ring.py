"""One shared-memory ring between two processes of one host: the channel under :mod:`chimera.util.shm`
(its module docstring gives the rules). Linux on x86-64: futexes on a shared mapping, x86's store order."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import threading
from collections import deque
from typing import Any

import torch

#: messages up to this size go through shared memory, larger ones through gloo
MAX_MESSAGE_BYTES = 256 * 1024
#: ring bytes per channel (a multiple of 64; at least 64 + MAX_MESSAGE_BYTES + 64)
RING_BYTES = 1024 * 1024
#: the largest ring a channel opened for large messages gets (its messages up to half of it)
MAX_CHANNEL_BYTES = 256 * 2**20
_DATA = 256  # header: futex word @0, head @64, tail @128, sender pid @192, receiver pid @200, message limit @208
_SYS_FUTEX, FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1
LIVENESS_S = 1.0  # a waiter checks that its peer process is alive this often
POLL_S = 0.0005  # how often a full ring is retried (room freed wakes no one)


def supported() -> bool:
    """Whether this platform has the transport (Linux, x86-64, /dev/shm)."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK))


def ring_bytes(max_message: int) -> int:
    """The ring of a channel whose messages go up to ``max_message`` bytes: two of them, at least ``RING_BYTES``."""
    return max(RING_BYTES, 2 * (64 + -(-max_message // 64) * 64))



class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def futex(word: ctypes.c_void_p, op: int, val: int, timeout_s: float | None = None) -> None:
    """The futex syscall on the 32-bit word at ``word`` (a channel's ``pub_ptr``, made once)."""
    ts = None
    if timeout_s is not None:
        ts = ctypes.byref(_Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9)))
    _lib().syscall(_SYS_FUTEX, word, op, ctypes.c_int(val), ts, None, 0)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited one not yet reaped, a zombie, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


class Channel:
    """One direction between two ranks: a ring of messages (8-byte size header, data, 64-byte aligned)."""

    def __init__(self, path: str, create: bool, max_message: int = MAX_MESSAGE_BYTES) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:  # the pages reserved now: a full /dev/shm fails here (gloo's then), not with SIGBUS later
                os.posix_fallocate(fd, 0, _DATA + ring_bytes(max_message))
            size = os.fstat(fd).st_size  # the opening side takes the ring its creator made
            # its pages mapped now (a ring written for the first time would fault them in during the first steps)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
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
        self.limit = ctypes.c_int64.from_buffer(self.mm, 208)  # the largest message this channel takes
        if create:
            self.limit.value = max_message
        self.ring = size - _DATA
        self.max_message = int(self.limit.value)
        self.words = (ctypes.c_int64 * (self.ring // 8)).from_buffer(self.mm, _DATA)
        self.base = ctypes.addressof(self.words)  # the ring's first byte: messages are copied with memmove
        self.pub_ptr = ctypes.c_void_p(ctypes.addressof(self.pub))  # the futex calls' argument, made once
        self.lock = threading.RLock()  # the main thread and the background thread move the channel on
        self.pending: deque[Any] = deque()  # sends not yet written (ring full), in order
        self.posted: deque[Any] = deque()  # receives posted, not yet filled, in order

    # -- sender ------------------------------------------------------------------------------------
    def try_write(self, src: torch.Tensor, n: int) -> bool:
        """Write the ``n`` bytes of ``src`` (a contiguous CPU tensor) if the ring has room; False if not (nothing
        written)."""
        need = 64 + -(-n // 64) * 64
        head, tail, ring = self.head.value, self.tail.value, self.ring
        pos = head % ring
        skip = 0
        # wrap where the message does not fit before the end (it never straddles it; need <= ring / 2), and only
        # there: the bytes skipped count as used until the receiver passes them (an empty ring started over at
        # position p has p - need free: at p = need, none)
        if ring - pos < need:
            skip = ring - pos
        if ring - (head - tail) < skip + need:
            return False
        if skip:
            self.words[pos // 8] = -1
            pos = 0
        self.words[pos // 8] = n
        if n:  # memmove, not a torch copy: no tensor views made per message
            ctypes.memmove(self.base + pos + 64, src.data_ptr(), n)
        self.head.value = head + skip + need  # after the data: x86 keeps the order of stores
        self.pub.value = (self.pub.value + 1) & 0x7FFFFFFF
        futex(self.pub_ptr, _FUTEX_WAKE, 1)  # a syscall: the reader either sees pub moved or is woken
        return True

    def flush(self) -> None:
        """Write the pending sends that now fit, in order."""
        with self.lock:
            while self.pending and self.try_write(self.pending[0].tensor, self.pending[0].nbytes):
                self.pending.popleft().done = True

    # -- receiver ----------------------------------------------------------------------------------
    def try_read(self, dst: torch.Tensor | None, nbytes: int) -> bool:
        """Read the next message into ``dst`` (a contiguous CPU tensor of ``nbytes`` bytes; None: skip it) if there
        is one; False if the ring is empty."""
        while True:
            tail = self.tail.value
            if self.head.value == tail:
                return False
            pos = tail % self.ring
            n = self.words[pos // 8]
            if n >= 0:
                break
            self.tail.value = tail + self.ring - pos  # the sender wrapped
        if n != nbytes:
            raise RuntimeError(f"shared-memory channel {self.path}: the next message has {n} bytes, the receive "
                               f"posted for it {nbytes}: the two ranks' schedules disagree")
        if n and dst is not None:
            ctypes.memmove(dst.data_ptr(), self.base + pos + 64, n)
        self.tail.value = tail + 64 + -(-n // 64) * 64
        return True

    def close(self) -> None:
        self.pending.clear()
        self.posted.clear()
        del self.pub, self.head, self.tail, self.pids, self.limit, self.words, self.base
        with contextlib.suppress(BufferError):
            self.mm.close()

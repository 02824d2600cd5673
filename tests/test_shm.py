"""The shared-memory p2p transport (chimera.util.shm) between two forked processes: gloo's matching rules (the
n-th receive gets the n-th message, whatever order the works are waited in), sends that never block when the ring
is full, large messages left to gloo, and waits that end with an error naming what went wrong (a deadline, a peer
that exited, two schedules that disagree). Whole runs go through it in every Ray and parity test (p2p auto)."""

from __future__ import annotations

import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from chimera.util import shm
from chimera.util.processes import LocalProcesses
from chimera.util.shm import MAX_MESSAGE_BYTES, RING_BYTES, ShmChannels
from chimera.util.shm_ring import Channel

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory p2p needs Linux on x86-64")

PAIRS = [("pipe down", 0, 1), ("pipe down", 1, 0)]


def _main(rank: int, fn: Callable[[int, ShmChannels], Any], init: str, q: Any) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
        chans = ShmChannels.open(rank, PAIRS, enabled=True)
        q.put((rank, "ok", fn(rank, chans)))
        chans.close()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
    finally:
        q.close()
        q.join_thread()  # the result is out before the process ends
        os._exit(0)  # no teardown that could wait on a peer that failed


def _run(fn: Callable[[int, ShmChannels], Any], timeout: float = 60.0) -> dict[int, tuple[str, Any]]:
    """``fn(rank, channels)`` in two processes from the runtime's forkserver (as its workers start), over gloo."""
    init = f"file://{tempfile.mkdtemp()}/rdv"
    out: dict[int, tuple[str, Any]] = {}
    with LocalProcesses(_main, [(r, fn, init) for r in range(2)], RuntimeError, "test process") as procs:
        for rank, status, value in procs.messages(timeout, lambda: f"ranks {sorted({0, 1} - set(out))}"):
            out[rank] = (status, value)
            if len(out) == 2:
                procs.finished = True
                break
    return out


def _ok(out: dict[int, tuple[str, Any]]) -> dict[int, Any]:
    errors = [v for s, v in out.values() if s != "ok"]
    assert not errors, errors
    return {r: v for r, (_, v) in out.items()}


def _sizes() -> list[int]:
    # tiny, odd-sized, up to the largest shared-memory message: enough bytes to wrap the ring several times
    return [1, 3, 17, 1000, 16 * 1024 + 5, MAX_MESSAGE_BYTES // 4 - 1, MAX_MESSAGE_BYTES // 4] * 6  # floats


def _ordered(rank: int, chans: ShmChannels) -> Any:
    sizes = _sizes()
    assert sum(4 * n for n in sizes) > 3 * RING_BYTES
    if rank == 0:
        works = [chans.post("pipe down", 1, True, torch.full((n,), float(i), dtype=torch.float32))
                 for i, n in enumerate(sizes)]
        assert all(w is not None for w in works)
        assert any(not w.done for w in works), "the ring never filled: the test does not reach pending sends"
        for w in works:
            w.wait(timedelta(seconds=30))
        return None
    time.sleep(0.5)  # the sender posts everything first: its ring fills, the rest waits in its pending queue
    bufs = [torch.empty(n, dtype=torch.float32) for n in sizes]
    works = [chans.post("pipe down", 0, False, b) for b in bufs]
    for w in reversed(works):  # waited in reverse: still matched in posting order
        w.wait(timedelta(seconds=30))
    return [bool((b == float(i)).all()) for i, b in enumerate(bufs)]


def test_messages_match_receives_in_posting_order_and_a_full_ring_does_not_block_the_sender():
    got = _ok(_run(_ordered))
    assert got[1] == [True] * len(_sizes())


def test_a_ring_emptied_anywhere_keeps_room_for_half_its_bytes_of_small_messages(tmp_path):
    """A send on an empty ring writes at once, whatever position the ring was emptied at: a ring takes half its
    bytes of small messages, and a ring of two of its largest messages (a replica pair's gradient buckets) takes
    two. Bytes skipped to start over at the front count as used until the receiver passes them, so starting over
    whenever the ring was empty once left a ring of tiny messages full after one message, and the next send waited
    for the background thread's poll; starting over when it was empty past its middle left the large ring one."""
    path = str(tmp_path / "ring")
    writer = Channel(path, create=True)
    reader = Channel(path, create=False)
    msg = torch.arange(64, dtype=torch.uint8)  # 128 ring bytes with its header
    per_half = (writer.ring // 2) // 128
    out = torch.empty(64, dtype=torch.uint8)
    at = 0  # messages through the ring so far
    try:
        for emptied_at in (1, 2, 3, 64, per_half - 1, per_half, per_half + 1, 2 * per_half - 1, 2 * per_half + 2):
            while at < emptied_at:  # one message on at a time: the ring empty at the next position
                assert writer.try_write(msg, 64) and reader.try_read(out, 64)
                at += 1
            fits = 0
            while fits < per_half - 1 and writer.try_write(msg, 64):
                fits += 1
            assert fits == per_half - 1, f"emptied after {emptied_at} messages, the ring took {fits} more"
            for _ in range(fits):
                assert reader.try_read(out, 64) and torch.equal(out, msg)
            assert not reader.try_read(out, 64)
            at += fits
    finally:
        reader.close()
        writer.close()
    n = 2**20  # the largest message's bytes
    big = Channel(str(tmp_path / "big"), create=True, max_message=n)  # a ring of two of its largest messages
    peer = Channel(str(tmp_path / "big"), create=False)
    large, got = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    try:
        for emptied_at in range(4):
            assert big.try_write(large, n) and big.try_write(large, n), f"emptied after {emptied_at}: not two messages"
            assert not big.try_write(large, n)
            assert peer.try_read(got, n) and peer.try_read(got, n) and not peer.try_read(got, n)
            assert big.try_write(large, n) and peer.try_read(got, n)  # one message on
    finally:
        peer.close()
        big.close()


def _large_and_missing(rank: int, chans: ShmChannels) -> Any:
    big = torch.zeros(MAX_MESSAGE_BYTES // 4 + 1)
    off_cpu = torch.empty(2, device="meta")  # not in this process's memory (as a GPU's): gloo's
    strided = torch.zeros(4)[::2]
    return (chans.post("pipe down", 1 - rank, rank == 0, big) is None,  # over the limit: gloo's
            chans.post("pipe up", 1 - rank, rank == 0, torch.zeros(2)) is None,  # no such channel: gloo's
            len(chans.channels),
            chans.post("pipe down", 1 - rank, rank == 0, off_cpu) is None,
            chans.post("pipe down", 1 - rank, rank == 0, strided) is None)


def test_large_messages_channels_not_set_up_and_tensors_not_contiguous_on_the_cpu_are_left_to_gloo():
    got = _ok(_run(_large_and_missing))
    assert got == {0: (True, True, 2, True, True), 1: (True, True, 2, True, True)}


def _sized(rank: int, chans: ShmChannels) -> Any:
    """Rank 0 opens its channel for 3 MiB messages and asks nothing of rank 1's: the receiver reads the limit from
    the file its creator made, so both route a 3 MiB message through shared memory, and a larger one to gloo."""
    n = 3 * 2**20
    chans.add([("sum", 0, 1), ("sum", 1, 0)], {("sum", 0, 1): n} if rank == 0 else {})
    limits = (chans.channels[("sum", 0, 1)].max_message, chans.channels[("sum", 1, 0)].max_message)
    over = chans.post("sum", 1 - rank, rank == 0, torch.zeros(n // 4 + 1)) is None
    t = torch.arange(n // 4, dtype=torch.float32) if rank == 0 else torch.zeros(n // 4)
    w = chans.post("sum", 1 - rank, rank == 0, t)
    w.wait(timedelta(seconds=30))
    return limits, over, w is not None, bool((t == torch.arange(n // 4, dtype=torch.float32)).all())


def test_a_channel_opened_for_large_messages_carries_them_and_both_ends_read_one_limit():
    got = _ok(_run(_sized))
    assert got[0] == got[1] == ((3 * 2**20, MAX_MESSAGE_BYTES), True, True, True)


def test_large_channels_are_capped_by_the_ring_limit_and_by_their_share_of_the_room_in_dev_shm(monkeypatch):
    class Room:
        f_bavail, f_frsize = 40 * 2**20, 1  # a quarter: 10 MiB for this rank's large rings

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Room())
    keys = [("a", 0, 1), ("b", 0, 1), ("c", 0, 1), ("d", 0, 1)]
    sizes = {("a", 0, 1): 4 * 2**20, ("b", 0, 1): 4 * 2**20, ("c", 0, 1): 2**10}
    assert shm._limits(keys, sizes) == {("a", 0, 1): 4 * 2**20, ("b", 0, 1): MAX_MESSAGE_BYTES,  # a took 8 MiB
                                        ("c", 0, 1): MAX_MESSAGE_BYTES, ("d", 0, 1): MAX_MESSAGE_BYTES}
    assert shm._limits(keys[:1], {keys[0]: 4 * 2**20}, sharing=4) == {keys[0]: MAX_MESSAGE_BYTES}  # 10/4 MiB each
    Room.f_bavail = 2**40
    assert shm._limits(keys[:1], {keys[0]: shm.MAX_CHANNEL_BYTES}) == {keys[0]: MAX_MESSAGE_BYTES}  # ring too large
    assert shm.ring_bytes(MAX_MESSAGE_BYTES) == RING_BYTES and shm.ring_bytes(4 * 2**20) == 2 * (4 * 2**20 + 64)


def _timeout(rank: int, chans: ShmChannels) -> Any:
    if rank == 0:
        time.sleep(1)  # past rank 1's deadline
        return None
    w = chans.post("pipe down", 0, False, torch.empty(4))
    t0 = time.monotonic()
    w.wait(timedelta(seconds=0.5))
    return time.monotonic() - t0


def test_a_receive_that_gets_nothing_fails_at_its_deadline():
    out = _run(_timeout)
    status, msg = out[1]
    assert status == "error" and "timed out after 0.5 s" in msg, msg


def _peer_exits(rank: int, chans: ShmChannels) -> Any:
    if rank == 0:
        return None  # the process ends (os._exit) without sending
    w = chans.post("pipe down", 0, False, torch.empty(4))
    t0 = time.monotonic()
    try:
        w.wait(timedelta(seconds=60))
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return "completed", 0.0


def test_a_peer_that_exits_is_noticed_within_seconds_not_at_the_deadline():
    out = _run(_peer_exits)
    msg, waited = out[1][1]
    assert "exited" in msg and waited < 5, (msg, waited)


def _mismatch(rank: int, chans: ShmChannels) -> Any:
    if rank == 0:
        chans.post("pipe down", 1, True, torch.zeros(8)).wait(timedelta(seconds=10))
        return None
    chans.post("pipe down", 0, False, torch.empty(4)).wait(timedelta(seconds=10))


def test_a_message_of_another_size_than_its_receive_is_refused_by_name():
    status, msg = _run(_mismatch)[1]
    assert status == "error" and "32 bytes, the receive posted for it 16" in msg, msg


def _communicator(rank: int, chans: ShmChannels) -> Any:
    from chimera.runtime.comm import Communicator, Op
    from chimera.schedule import build_schedule
    from chimera.util.shm import ShmWork

    out = []
    for p2p in ("auto", "gloo"):  # (the job's --p2p reaches the communicator: tests/test_bench_vs_torch.py)
        comm = Communicator(build_schedule("chimera", 2, 2), rank, p2p=p2p)
        w = comm.post([Op(rank == 0, torch.ones(4) if rank == 0 else torch.zeros(4), 1 - rank,
                          comm.pipe_groups["up"])])[0]
        comm.wait(w, "a test message")
        out.append((sorted(comm.shm.channels), isinstance(w, ShmWork)))
        comm.close()
    return out


def test_the_communicator_sets_up_a_channel_per_direction_and_pipe_and_none_with_p2p_gloo():
    got = _ok(_run(_communicator))
    pairs = [(f"pipe {p}", a, b) for p in ("down", "up") for a, b in ((0, 1), (1, 0))]
    assert got[0] == got[1] == [(sorted(pairs), True), ([], False)]


def _no_room(rank: int, chans: ShmChannels) -> Any:
    import errno
    import glob

    if rank == 0:  # /dev/shm full for rank 0: its channel to rank 1 cannot be made
        def full(fd: int, offset: int, size: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        shm.os.posix_fallocate = full  # type: ignore[attr-defined]
    more = ShmChannels.open(rank, [("x", 0, 1), ("x", 1, 0)], enabled=True)
    dist.barrier()
    left = glob.glob("/dev/shm/chimera-*")
    return sorted(more.channels), left


def test_a_channel_that_cannot_be_made_is_left_to_gloo_on_both_ends_and_no_file_is_left_behind():
    got = _ok(_run(_no_room))
    assert got[0] == got[1] == ([("x", 1, 0)], [])


def _background(rank: int, chans: ShmChannels) -> Any:
    sizes = _sizes()
    if rank == 0:  # posts more than the ring holds, then waits on gloo only: the pending sends go out meanwhile
        works = [chans.post("pipe down", 1, True, torch.full((n,), float(i))) for i, n in enumerate(sizes)]
        assert any(not w.done for w in works)
        ack = torch.zeros(1)
        dist.irecv(ack, 1).wait(timedelta(seconds=20))
        with works[-1].channel.lock:  # the flusher marks a send done under this lock, right after writing it
            return all(w.done for w in works)
    time.sleep(0.3)
    bufs = [torch.empty(n) for n in sizes]
    for w in [chans.post("pipe down", 0, False, b) for b in bufs]:
        w.wait(timedelta(seconds=15))
    dist.send(torch.ones(1), 0)
    return all(bool((b == float(i)).all()) for i, b in enumerate(bufs))


def test_sends_beyond_a_full_ring_go_out_while_the_sender_waits_on_something_else():
    assert _ok(_run(_background)) == {0: True, 1: True}


def _receiver_blocked_elsewhere(rank: int, chans: ShmChannels) -> Any:
    sizes = _sizes()
    if rank == 0:  # waits until every send is written, which takes room rank 1 makes, then joins the sum
        works = [chans.post("pipe down", 1, True, torch.full((n,), float(i))) for i, n in enumerate(sizes)]
        for w in works:
            w.wait(timedelta(seconds=15))
        dist.all_reduce(torch.ones(1), async_op=True).wait(timedelta(seconds=30))
        return True
    bufs = [torch.empty(n) for n in sizes]
    works = [chans.post("pipe down", 0, False, b) for b in bufs]  # posted, not waited: gloo would fill them now
    with chans.background():  # as Communicator.wait does around a gloo wait
        dist.all_reduce(torch.ones(1), async_op=True).wait(timedelta(seconds=30))
    for w in works:
        w.wait(timedelta(seconds=5))
    return all(bool((b == float(i)).all()) for i, b in enumerate(bufs))


def test_posted_receives_fill_while_the_receiver_blocks_on_gloo_so_its_peer_is_not_held_up():
    assert _ok(_run(_receiver_blocked_elsewhere)) == {0: True, 1: True}


def _wake(spin_s: float, rank: int, chans: ShmChannels) -> Any:
    """Rank 1 waits ~0.5 s for rank 0's message with ``spin_s``; how often it slept on the futex, and what it got."""
    chans.spin_s = spin_s
    if rank == 0:
        time.sleep(0.5)  # the receiver is waiting by now
        chans.post("pipe down", 1, True, torch.ones(4)).wait(timedelta(seconds=30))
        return None
    sleeps = []
    real = shm.futex

    def counted(addr: Any, op: int, val: int, timeout_s: float | None = None) -> None:
        sleeps.append(op)
        real(addr, op, val, timeout_s)

    shm.futex = counted  # type: ignore[assignment]
    buf = torch.zeros(4)
    chans.post("pipe down", 0, False, buf).wait(timedelta(seconds=30))
    return sleeps.count(shm.FUTEX_WAIT), buf.tolist()


def test_a_waiting_receive_polls_for_its_spin_and_sleeps_on_the_futex_without_one():
    spun = _ok(_run(functools.partial(_wake, 5.0)))[1]
    slept = _ok(_run(functools.partial(_wake, 0.0)))[1]
    assert spun == (0, [1.0] * 4)  # the message found by polling: no sleep, no wake-up
    assert slept[0] >= 1 and slept[1] == [1.0] * 4


def test_p2p_spin_reaches_the_workers_channels_and_a_negative_one_is_refused(tmp_path):
    from chimera.compile import compile_job
    from chimera.config import ConfigError, TrainConfig
    from chimera.runtime.worker import PipelineWorker

    flags = dict(model="delay", model_overrides={"num_blocks": 1, "fwd_s": 0.0}, schedule="1f1b", stages=1,
                 micro_batches=2, steps=1, threads=1, corpus="synthetic", partition="uniform")
    for spin, want in ((None, shm.SPIN_S), (0.25, 0.25)):
        extra = {} if spin is None else {"p2p_spin_s": spin}
        w = PipelineWorker(compile_job(TrainConfig.from_flags(**flags, **extra)), 0, 1,
                           f"file://{tmp_path}/rdv-{spin}")
        w.setup()
        try:
            assert w.comm.shm is not None and w.comm.shm.spin_s == want
        finally:
            w.close()
    with pytest.raises(ConfigError, match="--p2p-spin must be >= 0"):
        compile_job(TrainConfig.from_flags(**flags, p2p_spin_s=-1.0))


def test_the_p2p_spin_default_is_one_figure_in_the_config_the_job_and_the_transport():
    """The layers keep their own copies (the request imports nothing, the job holds decisions): they must agree."""
    import dataclasses

    from chimera.config import TrainConfig
    from chimera.job import RunOptions

    job_default = {f.name: f.default for f in dataclasses.fields(RunOptions)}["p2p_spin_s"]
    config_default = TrainConfig.from_flags(model="delay").training.p2p_spin_s
    assert config_default == job_default == shm.SPIN_S

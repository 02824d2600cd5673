"""Gradient sums between two ranks through shared memory: a pair of replicas exchanges its buckets and a tied
pair its sum on channels sized to their largest message (larger than the pipe's default), and both ranks end with
the same sum, bit for bit, as the allreduce gave (``a + b == b + a``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chimera.util import shm
from chimera.util.shm import MAX_MESSAGE_BYTES, ShmChannels
from tests.test_shm import _ok, _run

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory p2p needs Linux on x86-64")


def _sums(rank: int, _: ShmChannels) -> Any:
    from chimera.compile import compile_job
    from chimera.config import TrainConfig
    from chimera.runtime.comm import Communicator
    from chimera.runtime.stage_state import StageState, tied_ranks
    from chimera.util.shm import ShmWork

    job = compile_job(TrainConfig.from_flags(model="bert-tiny", schedule="chimera", stages=2, micro_batches=2,
                                             micro_batch_size=2, partition="1,3", corpus="synthetic"))
    comm = Communicator(job.schedule, rank, tied_ranks(job).values(), p2p="auto")
    stages = StageState(job, rank, 0, torch.device("cpu"), comm)
    limits = {k[0]: ch.max_message for k, ch in comm.shm.channels.items() if not k[0].startswith("pipe")}
    g = torch.Generator().manual_seed(rank)
    named = {f"{st}/{n}": p for (_, st), mod in stages.modules.items() for n, p in mod.named_parameters()}
    for p in named.values():
        p.grad = torch.randn(p.shape, generator=g)
    mine = {k: p.grad.numpy().copy() for k, p in named.items()}  # numpy: tensors would travel as shared fds
    paths = []
    for buckets in stages.buckets.values():  # every sum started, then waited (the ranks list stages in other orders)
        buckets.start()
        paths += [isinstance(w, ShmWork) for _, _, works, _ in buckets._pending for w in works]
    for buckets in stages.buckets.values():
        buckets.wait("a test sum")
    stages.sum_tied(0)
    tied = {id(p) for ends, _, _ in stages.tied for p in ends}
    return limits, paths, {k: p.grad.numpy().copy() for k, p in named.items()}, mine, \
        sorted(k for k, p in named.items() if id(p) in tied)


def test_replica_buckets_and_tied_pairs_sum_through_shared_memory_bitwise_alike_on_both_ranks():
    got = _ok(_run(_sums, timeout=120))
    (lim0, paths0, *_), (lim1, paths1, *_) = got[0], got[1]
    assert set(lim0) == {"stage 0", "stage 1", "tied"} and lim0 == lim1
    assert lim0["tied"] > MAX_MESSAGE_BYTES and lim0["stage 1"] > MAX_MESSAGE_BYTES  # the embedding: 1 MiB, more
    assert paths0 and all(paths0) and all(paths1)  # every bucket's send and receive on shared memory
    sums0, sums1 = got[0][2], got[1][2]
    mine0, mine1 = got[0][3], got[1][3]
    tied = got[0][4]
    assert sorted(sums0) == sorted(sums1) and len(tied) == 2 and tied == got[1][4]  # the word embedding, the decoder
    for k in sums0:
        assert torch.equal(torch.from_numpy(sums0[k]), torch.from_numpy(sums1[k])), k  # bit for bit on both ranks
        if k not in tied:
            assert torch.equal(torch.from_numpy(sums0[k]), torch.from_numpy(mine0[k]) + torch.from_numpy(mine1[k])), k
    ends = [torch.from_numpy(m[tied[0]]) + torch.from_numpy(m[tied[1]]) for m in (mine0, mine1)]
    assert torch.equal(torch.from_numpy(sums0[tied[0]]), ends[0] + ends[1])  # every end of the pair: the sum

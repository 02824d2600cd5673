"""GPT-2 small (the ``gpt2-small`` preset: 12 blocks of 768, vocabulary 50257, embedding tied to the head) at D = 2
under 256 MiB per worker: refused before any worker starts without offload, naming bytes; ``--offload auto`` splits
the vocabulary (into 2 shards: the fewest that fit), streams the weights in packs of one layer and trains the
losses of the same run without a budget, every worker's measured peak within the budget.

Why the split: unsplit, the embedding layer (and the head tied to it) holds 154 MB of weights and its backward
makes 154 MB of gradients, so even packs of one layer, each gradient leaving as the backward makes it, need
340.7 MiB (two packs of weights 174.3 MiB, the embedding's gradients 147.2 MiB, activations 19.1 MiB). Split into 2,
packs of one layer need 240.1 MiB by the memory model.
"""

from __future__ import annotations

import pytest

from chimera.compile import compile_job, resolved_config
from chimera.config import ConfigError, TrainConfig
from chimera.offload import EVERYTHING, Offload
from chimera.runtime import run_local, train_sequential

BASE = TrainConfig.from_flags(model="gpt2-small", schedule="chimera", stages=2, micro_batches=2, micro_batch_size=1,
                              seq_len=16, steps=2, optimizer="adamw", corpus="synthetic", partition="uniform",
                              threads=1, memory_per_worker="256MiB")


def test_gpt2_small_unsplit_at_256mib_is_refused_naming_bytes():
    """Compile only: without offload, and with ``auto`` told not to split (``--vocab-shards 1`` given), refused
    before any worker starts, every figure in bytes."""
    with pytest.raises(ConfigError, match=r"budget of 268435456 bytes .*--offload none: 3295334400 bytes .* "
                                          r"parameters 652148736, optimizer state 1304297472"):
        compile_job(BASE)
    with pytest.raises(ConfigError, match=r"--offload everything \(packs of 1 layer, --offload-pack 1\): 357222476 "
                                          r"bytes .* parameters 182747136, optimizer state 0, gradients 154395648"):
        compile_job(BASE.with_flags(offload="auto", vocab_shards=1))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt2_small_at_256mib_offload_auto_trains_like_no_budget():
    """``--offload auto`` alone: whole-stage swaps and even packs of one layer do not fit the unsplit model, so it
    splits the vocabulary (the fewest shards that fit), streams the weights in packs, says both, and trains two
    steps with the losses of the same run without a budget (the unsplit model, trained sequentially), every
    worker's measured peak within 256 MiB and within the memory model's."""
    job = compile_job(BASE.with_flags(offload="auto"))
    vocab, off = [d for d in job.decisions if d.startswith(("vocab auto:", "offload auto:"))]
    assert job.chain.vocab_shards == 2 and "into 2 layers each (--vocab-shards 2" in vocab
    assert "the least needs 357222476 bytes, budget 268435456" in vocab  # why: the unsplit model's least, named
    assert job.offload == Offload.uniform(EVERYTHING, prefetch=1, pack=1)
    assert "packs of 1 layer, --offload-pack 1" in off and "whole-stage swaps do not fit" in off
    model_peak = int(off.split(" bytes at the largest worker's peak")[0].rsplit(" ", 1)[1])
    assert model_peak <= 256 * 2**20
    assert resolved_config(BASE.with_flags(offload="auto"), job).model.vocab_shards == 2
    got = run_local(job)
    for m in got.metrics:
        assert all(0 < w["total"] <= model_peak for w in m["memory_peak_bytes"]), m["memory_peak_bytes"]
    unsplit = compile_job(BASE.with_flags(memory_per_worker=None))
    assert unsplit.chain.vocab_shards == 1
    assert [m["loss"] for m in got.metrics] == pytest.approx(train_sequential(unsplit).losses, abs=1e-5)

"""GPT-2 small (the ``gpt2-small`` preset: 12 blocks of 768, vocabulary 50257, embedding tied to the head) at D = 2
under 256 MiB per worker: refused before any worker starts, naming bytes; with the vocabulary split into 8 shards
(``--vocab-shards 8``) ``--offload auto`` streams the weights in packs by itself and trains the same losses as
without a budget, every worker's measured peak within the budget.

Why the split: unsplit, the embedding layer (and the head tied to it) holds 154 MB of weights and its backward
makes 154 MB of gradients, so even packs of one layer, each gradient leaving as the backward makes it, need
340.7 MiB (two packs of weights 174.3 MiB, the embedding's gradients 147.2 MiB, activations 19.1 MiB). Split into 8,
the largest layer is a block (28 MB): packs of one layer need 100.6 MiB, packs of two 181.7 MiB.
"""

from __future__ import annotations

import pytest

from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.offload import EVERYTHING, Offload
from chimera.runtime import run_local, train_sequential

BASE = TrainConfig.from_flags(model="gpt2-small", schedule="chimera", stages=2, micro_batches=2, micro_batch_size=1,
                              seq_len=16, steps=2, optimizer="adamw", corpus="synthetic", partition="uniform",
                              threads=1, memory_per_worker="256MiB")


def test_gpt2_small_unsplit_at_256mib_is_refused_naming_bytes():
    """Compile only: without offload and with ``auto``, refused before any worker starts, every figure in bytes."""
    with pytest.raises(ConfigError, match=r"budget of 268435456 bytes .*--offload none: 3295334400 bytes .* "
                                          r"parameters 652148736, optimizer state 1304297472"):
        compile_job(BASE)
    with pytest.raises(ConfigError, match=r"--offload everything \(packs of 1 layer, --offload-pack 1\): 357222476 "
                                          r"bytes .* parameters 182747136, optimizer state 0, gradients 154395648"):
        compile_job(BASE.with_flags(offload="auto"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt2_small_split_by_vocabulary_trains_at_256mib_like_no_budget():
    """Split into 8: still refused without offload; ``auto`` finds whole-stage swaps too large, streams packs (of
    two layers: the largest that fits), says so, and trains two steps with sequential training's losses, every
    worker's measured peak within 256 MiB and within the memory model's."""
    split = BASE.with_flags(vocab_shards=8)
    with pytest.raises(ConfigError, match=r"budget of 268435456 bytes .*--offload none: 3295334400 bytes"):
        compile_job(split)
    job = compile_job(split.with_flags(offload="auto"))
    assert job.offload == Offload.uniform(EVERYTHING, prefetch=1, pack=2)
    (why,) = [d for d in job.decisions if d.startswith("offload auto:")]
    assert "packs of 2 layers, --offload-pack 2" in why and "whole-stage swaps do not fit" in why
    assert "190533708 bytes at the largest worker's peak" in why
    got = run_local(job)
    for m in got.metrics:
        assert all(0 < w["total"] <= 190533708 for w in m["memory_peak_bytes"]), m["memory_peak_bytes"]
    assert [m["loss"] for m in got.metrics] == pytest.approx(train_sequential(job).losses, abs=1e-6)

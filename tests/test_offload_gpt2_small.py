"""GPT-2 small (the ``gpt2-small`` preset: 12 blocks of 768, vocabulary 50257, embedding tied to the head) at D = 2
under a device budget: refused before any worker starts, naming bytes, and ``--offload auto`` choosing weight packs
by itself where whole-stage swaps do not fit, training the same losses as without a budget.

A budget of 256 MiB per worker cannot be met by any policy: the embedding layer alone (and the head tied to it)
holds 154 MB of weights, and its backward makes 154 MB of gradients on the device, so a pack of that one layer
needs about 300 MiB; with the stage's gradients kept until GRAD_OUT the least is packs of one layer at 503 MiB. The
check therefore trains at 512 MiB and asserts the refusal at 256 MiB.
"""

from __future__ import annotations

import pytest

from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.offload import EVERYTHING, Offload
from chimera.runtime import run_local, train_sequential

BASE = TrainConfig.from_flags(model="gpt2-small", schedule="chimera", stages=2, micro_batches=2, micro_batch_size=1,
                              seq_len=16, steps=2, optimizer="adamw", corpus="synthetic", partition="uniform",
                              threads=1)


def test_gpt2_small_at_256mib_is_refused_naming_bytes():
    """Compile only: without offload and with ``auto``, refused before any worker starts, every figure in bytes."""
    tight = BASE.with_flags(memory_per_worker="256MiB")
    with pytest.raises(ConfigError, match=r"budget of 268435456 bytes .*--offload none: 3295334400 bytes .* "
                                          r"parameters 652148736, optimizer state 1304297472"):
        compile_job(tight)
    with pytest.raises(ConfigError, match=r"--offload everything \(packs of 1 layer, --offload-pack 1\): 527331404 "
                                          r"bytes"):
        compile_job(tight.with_flags(offload="auto"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt2_small_auto_offload_trains_like_no_budget():
    """512 MiB: refused without offload; ``auto`` picks packs of one layer (whole stages do not fit at any prefetch),
    says so, and trains two steps with sequential training's losses, every worker within the budget."""
    budget = BASE.with_flags(memory_per_worker="512MiB")
    with pytest.raises(ConfigError, match=r"budget of 536870912 bytes .*--offload none: 3295334400 bytes"):
        compile_job(budget)
    job = compile_job(budget.with_flags(offload="auto"))
    assert job.offload == Offload.uniform(EVERYTHING, prefetch=1, pack=1)
    (why,) = [d for d in job.decisions if d.startswith("offload auto:")]
    assert "packs of 1 layer, --offload-pack 1" in why and "whole-stage swaps do not fit" in why
    got = run_local(job)
    assert all(0 < w["total"] <= 512 * 2**20 for m in got.metrics for w in m["memory_peak_bytes"])
    assert [m["loss"] for m in got.metrics] == pytest.approx(train_sequential(job).losses, abs=1e-5)

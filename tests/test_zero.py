"""--shard-optimizer (ZeRO-1 over each stage's replicas): the same training bit for bit, every rank keeping only its
share of the optimizer state, in the memory model as in what the runtime holds; refused where unsupported."""

import pytest
import torch

from chimera.compile import compile_job
from chimera.compile.shard import assign
from chimera.config import ConfigError, TrainConfig
from chimera.plan import worker_memory
from chimera.profile.shapes import shapes_profile
from chimera.runtime import run_local

pytestmark = pytest.mark.timeout(240)

BASE = TrainConfig.from_flags(model="bert-tiny", micro_batch_size=2, seq_len=16, steps=3, optimizer="adamw", lr=1e-3,
                              timeout_s=60, check_replicas=True, corpus="synthetic", partition="uniform",
                              warmup_steps=1, lr_schedule="linear")


def _states_equal(a, b) -> bool:  # noqa: ANN001
    return all(torch.equal(a.states[r][k][n], b.states[r][k][n]) for r in a.states for k in a.states[r]
               for n in a.states[r][k])


@pytest.mark.parametrize("flags", [
    {"schedule": "chimera", "stages": 4, "micro_batches": 4},
    {"schedule": "chimera", "stages": 2, "micro_batches": 2, "data_parallel": 2},
    {"schedule": "1f1b", "stages": 2, "micro_batches": 2, "data_parallel": 2, "model": "gpt2-tiny"},
], ids=["chimera-D4", "chimera-D2-W2", "1f1b-W2-gpt2"])
def test_sharded_optimizer_trains_bit_for_bit_the_same(flags):
    """Losses, gradient norms, learning rates and every replica's parameters equal to the unsharded run, bitwise
    (``check_replicas``: every stage's replicas also compare their digests after every step)."""
    cfg = BASE.with_flags(**flags)
    plain = run_local(compile_job(cfg), return_state=True)
    job = compile_job(cfg.with_flags(shard_optimizer=True))
    assert job.shards is not None and job.shards.owners
    sharded = run_local(job, return_state=True)
    for key in ("loss", "grad_norm", "lr"):
        assert [m[key] for m in sharded.metrics] == [m[key] for m in plain.metrics], key
    assert _states_equal(plain, sharded)
    # every parameter of a replicated stage has one owner in its group, and every member owns some of its stages
    for s, owners in job.shards.owners.items():
        assert {r for _, _, r in owners} <= set(job.schedule.stage_group(s))
    held = {r for s in job.shards.owners for r in job.schedule.stage_group(s)}
    assert all(sum(job.shards.owned_bytes(r, s) for s in job.shards.owners) > 0 for r in held)


def test_memory_model_counts_only_the_owned_share():
    """Chimera D = 4: every stage has two replicas, so the group keeps its optimizer state once instead of twice;
    each worker's modelled bytes drop by exactly what its optimizer state drops, and (the balance) by about half."""
    cfg = BASE.with_flags(schedule="chimera", stages=4, micro_batches=4)
    plain, job = compile_job(cfg), compile_job(cfg.with_flags(shard_optimizer=True))
    prof = shapes_profile(job.chain, job.unit_size)
    before = worker_memory(prof, job.schedule, job.stage_layers, job.unit_size, "adamw", False)
    after = worker_memory(prof, job.schedule, job.stage_layers, job.unit_size, "adamw", False,
                          optimizer_owned=job.shards.per_worker(job.schedule))
    assert plain.schedule == job.schedule
    for b, a in zip(before, after):
        assert b.total - a.total == b.optimizer - a.optimizer > 0
        assert 0.4 <= a.optimizer / b.optimizer <= 0.6, (a.optimizer, b.optimizer)
    assert sum(a.optimizer for a in after) * 2 == sum(b.optimizer for b in before)


def test_assignment_balances_over_every_stage():
    """The largest parameters of two stages held by the same two ranks go to different ranks, and each rank
    owns as many bytes as the other (largest first, to the least loaded)."""
    owners = assign({0: [("small0", 10), ("big0", 100)], 3: [("big3", 100), ("small3", 10), ("mid3", 20)]},
                    {0: [0, 3], 3: [0, 3]})
    assert [n for n, _, _ in owners[0]] == ["small0", "big0"]  # each stage's in its own order
    assert {owners[0][1][2], owners[3][0][2]} == {0, 3}
    load = {r: sum(n for own in owners.values() for _, n, o in own if o == r) for r in (0, 3)}
    assert load == {0: 120, 3: 120}, load


@pytest.mark.parametrize("flags,msg", [
    ({"offload": "optimizer"}, "--offload none or drop --shard-optimizer"),
    ({"data_parallel": 32}, "rank 47 would own no parameter's optimizer state"),  # 47 parameters, 64 replicas
])
def test_unsupported_combinations_are_refused(flags, msg):
    cfg = BASE.with_flags(schedule="chimera", stages=2, micro_batches=2, shard_optimizer=True, **flags)
    with pytest.raises(ConfigError, match=msg):
        compile_job(cfg)
    assert compile_job(cfg.with_flags(shard_optimizer=False)).shards is None


def test_the_flag_on_the_command_line():
    from chimera.cli.options import add_config_args, config_from_args, parser

    p = parser("chimera train", "")
    add_config_args(p)
    assert config_from_args(p.parse_args(["--shard-optimizer"]))[0].training.shard_optimizer
    assert not config_from_args(p.parse_args([]))[0].training.shard_optimizer


def test_auto_prices_the_sharded_optimizer_state():
    """``--schedule auto`` under a budget prices every candidate with its own sharding: at 34 MiB per worker a
    two-share schedule (BitPipe) fits once an extra replica costs its weights and gradients but only half its
    optimizer state; unsharded it needs more, and the one-share ZB-V is the fastest that fits."""
    from chimera.compile import compile_job

    cfg = TrainConfig.from_flags(model="delay", model_overrides={"num_blocks": 8, "hidden_size": 512, "fwd_s": 0.01},
                                 schedule="auto", stages=4, micro_batches=4, micro_batch_size=2, steps=1,
                                 optimizer="adamw", corpus="synthetic", partition="uniform", memory_per_worker="34MiB")
    plain = compile_job(cfg).decisions[0]
    sharded = compile_job(cfg.with_flags(shard_optimizer=True)).decisions[0]
    assert plain.startswith("auto: zb-v:") and "bitpipe (needs 36.1 MiB of 34.0 MiB)" in plain, plain
    assert sharded.startswith("auto: bitpipe:"), sharded

"""Weights in packs of layers (``--offload-pack``): schedule, simulator costs, memory model and runtime agree."""

from __future__ import annotations

import dataclasses

import pytest
from test_runtime_parity import assert_same_run

from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.offload import Offload
from chimera.offload.lowering import lower
from chimera.plan.costs import simulator_costs
from chimera.plan.memory import swap_bytes, worker_memory
from chimera.profile.shapes import shapes_profile
from chimera.runtime import run_local
from chimera.schedule import Kind, build_schedule, simulate, validate

#: a hang fails a test here within this many seconds (pytest-timeout), not at CI's limit
pytestmark = pytest.mark.timeout(240)

# GPT-2-tiny with 8 blocks: a stage is the embedding (or head) and 4 blocks, so packs of one layer hold much less
GPT2 = dict(model="gpt2-tiny", schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2, seq_len=16,
            steps=2, optimizer="adamw", corpus="synthetic", partition="uniform", threads=1,
            model_overrides={"n_layer": 8}, offload="everything", prefetch=0)
BUDGET = "17MiB"  # the model: 18.7 MiB per worker with whole stages swapped, 16.4 MiB with packs of one layer


def test_packed_stages_swap_inside_their_compute_and_cost_it():
    """No swap action for a stage in packs (its compute moves them); its forward and backward cost the copies."""
    from chimera.plan.partition import layers_of
    from chimera.profile import Link
    from chimera.profile.synthetic import bert48_paper_like

    sched = build_schedule("chimera", 2, 4)
    off = Offload.parse("everything,optimizer", 1, pack=4)
    lowered = validate(lower(sched, off))
    kinds = {(a.kind, a.stage) for row in lowered.actions for a in row}
    assert (Kind.GRAD_OUT, 0) in kinds and not {(Kind.SWAP_IN, 0), (Kind.SWAP_OUT, 0)} & kinds
    assert (Kind.SWAP_IN, 1) in kinds  # the optimizer stage's updated weights after the step, as before
    gpu = dataclasses.replace(bert48_paper_like(), host_in=Link(1e-3, 1e9), host_out=Link(1e-3, 1e9))
    layers = layers_of([24, 24])
    unit = gpu.micro_batch_sizes[0]
    times = [gpu.host_in.time(sum(gpu.layers[i].param_bytes for i in layers[0][j:j + 4])) for j in range(0, 24, 4)]
    for prof in (dataclasses.replace(gpu, device="cpu"), gpu):
        plain = simulator_costs(prof, layers, unit, False, sched)
        packed = simulator_costs(prof, layers, unit, False, sched, offload=off)
        if prof.device == "cpu":  # synchronous copies: every pack's
            assert packed.fwd[0] == pytest.approx(plain.fwd[0] + sum(times))
            # the first stage's whole backward is its W (its I computes nothing)
            assert packed.bwd[0] == plain.bwd[0] == 0
            assert packed.wgrad[0] == pytest.approx(plain.wgrad[0] + sum(times))
        else:  # a copy stream: the first pack's, and the rest beyond the compute they run beside
            assert packed.fwd[0] == pytest.approx(plain.fwd[0] + times[0] + max(0, sum(times[1:]) - plain.fwd[0]))
        assert (packed.fwd[1], packed.bwd[1]) == (plain.fwd[1], plain.bwd[1])  # not in packs
        assert simulate(lowered, packed).makespan > simulate(lowered, plain).makespan


def test_a_budget_that_fits_only_with_packs():
    """Refused without packs; with packs of one layer it trains within the budget (the runtime's own peak after
    every action, with the packs held during it), like training without offload, moving the predicted bytes."""
    base = TrainConfig.from_flags(**GPT2)
    with pytest.raises(ConfigError, match=r"--offload everything \(whole stages, --prefetch 0\): \d+ bytes .* Change: --offload-pack 1"):
        compile_job(base.with_flags(memory_per_worker=BUDGET))
    job = compile_job(base.with_flags(memory_per_worker=BUDGET, offload_pack=1))
    got = run_local(job, return_state=True)
    ref = run_local(compile_job(base.with_flags(offload="none")), return_state=True)
    assert_same_run(ref, got)
    prof = shapes_profile(job.chain, job.unit_size)
    off = Offload.parse("everything", 0, pack=1)
    predicted = swap_bytes(prof, job.schedule, job.stage_layers, off)
    modelled = worker_memory(prof, job.schedule, job.stage_layers, job.unit_size, "adamw", False, offload=off)
    biggest_stage = max(sum(prof.layers[i].param_bytes for i in layers) for layers in job.stage_layers)
    for m in got.metrics:
        assert m["swap_bytes"] == predicted
        for mm, w in zip(modelled, m["memory_peak_bytes"]):
            assert 0 < w["total"] <= 17 * 2**20
            assert w["params"] == mm.params < biggest_stage  # two packs of weights, as the model says
            # the model's stash is an upper bound (the backward's own unit is counted while it runs): measured
            # +26.1 %; the gradient in flight (each leaves as the backward makes it) as the model says, within a pack
            assert 1 <= mm.total / w["total"] <= 1.27
            assert 0 < w["grads"] <= mm.grads < biggest_stage


def test_pack_flag_is_checked():
    base = TrainConfig.from_flags(**{**GPT2, "offload": "optimizer"})
    with pytest.raises(ConfigError, match="--offload-pack 2 swaps weights in packs: give --offload everything"):
        compile_job(base.with_flags(offload_pack=2))
    with pytest.raises(ConfigError, match="--offload-pack must be >= 0"):
        compile_job(base.with_flags(offload="everything", offload_pack=-1))


def test_packs_with_recompute_and_per_stage_policies():
    """1F1B recomputing: a recomputing backward streams the packs twice (its forward again, then the backward)."""
    base = TrainConfig.from_flags(**{**GPT2, "schedule": "1f1b", "recompute": True, "offload": "none",
                                     "model_overrides": {}})
    job = compile_job(base.with_flags(offload="everything,optimizer+gradients", offload_pack=2, prefetch=1))
    got = run_local(job, return_state=True)
    assert_same_run(run_local(compile_job(base), return_state=True), got)
    prof = shapes_profile(job.chain, job.unit_size)
    predicted = swap_bytes(prof, job.schedule, job.stage_layers, Offload.parse("everything,optimizer+gradients", 1, 2),
                           recompute=True)
    once = swap_bytes(prof, job.schedule, job.stage_layers, Offload.parse("everything,optimizer+gradients", 1, 2))
    assert predicted[0] > once[0] and predicted[1] == once[1]  # only the recomputing (first) stage streams twice
    assert all(m["swap_bytes"] == predicted for m in got.metrics)


def test_auto_chooses_packs_says_so_and_its_resolved_config_keeps_them():
    """Compile only: whole stages do not fit the budget, so ``auto`` streams packs, names their size on its decision
    line, and the configuration written for the run (``resolved_config``) builds the same policy."""
    from chimera.compile import resolved_config

    cfg = TrainConfig.from_flags(**{**GPT2, "offload": "auto", "memory_per_worker": BUDGET})
    job = compile_job(cfg)
    (stage,) = job.offload.stages
    assert stage.packed and stage.level.name == "everything"
    (why,) = [d for d in job.decisions if d.startswith("offload auto:")]
    assert f"packs of {stage.pack} layer" in why and f"--offload-pack {stage.pack}" in why
    assert "whole-stage swaps do not fit" in why
    assert compile_job(resolved_config(cfg, job)).offload == job.offload

"""Offload on GPU as on CPU: offloaded gradients are summed over host buffers on a gloo group of their own, beside
the device groups (NCCL on GPU), exercised here on CPU to parity with sequential training; and the planner ranks,
for a GPU profile, only what the compiler accepts."""

from __future__ import annotations

import dataclasses

import pytest

from chimera.compile import compile_job
from chimera.compile.model import preset_chain
from chimera.config import TrainConfig
from chimera.plan import plan
from chimera.plan.planfile import plan_flags
from chimera.profile import Link, Profile, Timing
from chimera.profile.shapes import shapes_profile
from chimera.profile.synthetic import comm
from chimera.runtime import WorkerError, run_local, stage_params_by_layer, train_sequential

GPT2 = dict(model="gpt2-tiny", micro_batch_size=2, seq_len=16, steps=2, optimizer="adamw", corpus="synthetic",
            partition="uniform", threads=1, check_replicas=True)


def _groups_used(job, metrics: list[dict]) -> None:  # noqa: ANN001
    """Every replicated stage's gradients were summed on its host group where they are offloaded, on its device
    group elsewhere, never on the other; messages stayed on the pipes' (device) groups."""
    for m in metrics:
        ops = m["group_ops"]
        assert ops.get("pipe down", 0) > 0, ops
        for s in range(job.schedule.stages):
            if len(job.schedule.stage_group(s)) < 2:
                continue
            used, unused = (f"host {s}", f"stage {s}") if job.offload.gradients_at(s) else (f"stage {s}", f"host {s}")
            assert ops.get(used, 0) > 0 and unused not in ops, (s, ops)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [
    # a Chimera worker holds stage 0 (gradients summed on the host) and stage 1 (summed on the device); clipping and
    # GPT-2's tied embedding add the global and tied sums
    dict(schedule="chimera", stages=2, micro_batches=4, offload="optimizer+gradients,optimizer", clip_grad=1.0),
    # two data-parallel groups, weights in packs: every stage's sum on the host
    dict(schedule="1f1b", stages=2, micro_batches=2, data_parallel=2, offload="everything", offload_pack=1),
], ids=["chimera-mixed", "1f1b-W2-packs"])
def test_host_sums_on_their_own_group_train_like_sequential(flags):
    job = compile_job(TrainConfig.from_flags(**GPT2, **flags))
    got = run_local(job, return_state=True)
    ref = train_sequential(job)
    _groups_used(job, got.metrics)
    assert [m["loss"] for m in got.metrics] == pytest.approx(ref.losses, abs=1e-5)
    for state in got.states.values():
        for (_, stage), params in state.items():
            for k, v in stage_params_by_layer(params, job.stage_layers[stage]).items():
                assert (v - ref.params[k]).abs().max().item() <= 1e-5, (stage, k)


def _gpu_profile(chain, sizes: tuple[int, ...]) -> Profile:  # noqa: ANN001
    """The chain's real bytes (its shapes) with made-up times, as if profiled on a GPU with pinned-memory copies."""
    shapes = [shapes_profile(chain, b) for b in sizes]
    layers = []
    for i, lp in enumerate(shapes[0].layers):
        costs = {}
        for b, sp in zip(sizes, shapes):
            f = Timing(1e-3 * b * (1 + lp.param_bytes / 2**20))
            costs[b] = dataclasses.replace(sp.layers[i].costs[b], forward=f, backward_input=f, backward_weight=f,
                                           backward=Timing(2 * f.median_s), recompute=f)
        layers.append(dataclasses.replace(lp, costs=costs))
    return dataclasses.replace(shapes[0], device="cuda", dtype="float32", micro_batch_sizes=list(sizes), layers=layers,
                               comm=comm(5e-6, 1e10), host_in=Link(1e-5, 2e10), host_out=Link(1e-5, 2e10))


@pytest.mark.timeout(120)
def test_every_plan_ranked_for_a_gpu_compiles_for_it():
    """A budget that needs offload: the ranked plans include gradients and weights offloaded (prefetch 0, packs,
    per stage), and every one compiles on ``--device cuda`` with the same budget to the policy it was priced with."""
    base = TrainConfig.from_flags(**{**GPT2, "device": "cuda", "steps": 1})
    limit = 16 * 2**20
    result = plan(_gpu_profile(preset_chain(base), (1, 2)), 2, global_batch=8, memory_limit=limit)
    offloads = [e.candidate.offload for e in result.ranked]
    assert any(o.gradients for o in offloads) and any(not o.uniform_level for o in offloads)
    assert any(s.packed for o in offloads for s in o.stages)
    assert any(s.level.weights and not s.pack and s.prefetch == 0 for o in offloads for s in o.stages)
    for e in result.ranked:
        job = compile_job(base.with_flags(memory_per_worker=str(limit), **plan_flags(e)))
        assert job.offload == e.candidate.offload, e.candidate.label


def test_a_local_gpu_run_needs_a_gpu_per_worker():
    """NCCL refuses two ranks on one device: a local run with fewer visible GPUs than workers is refused before any
    worker starts (this machine may see none)."""
    import torch

    job = compile_job(TrainConfig.from_flags(**{**GPT2, "device": "cuda", "schedule": "1f1b", "stages": 2,
                                                "data_parallel": 2 + torch.cuda.device_count()}))
    with pytest.raises(WorkerError, match=r"one worker per GPU .* \d+ workers, \d+ GPU\(s\) visible"):
        run_local(job)

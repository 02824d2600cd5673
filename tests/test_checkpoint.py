"""Checkpoints: resume is bit-exact, a different D/schedule re-partitions by layer, an interrupted write never
replaces the last good checkpoint, and a corrupt or foreign checkpoint is refused before any worker starts."""

import json

import pytest
import torch

from chimera.checkpoint import complete, partial_dir
from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.runtime import run_local
from chimera.runtime.launch import WorkerError

BASE = TrainConfig.from_flags(model="bert-tiny", corpus="synthetic", seq_len=16, micro_batch_size=2, stages=2,
                              micro_batches=2, steps=6, optimizer="lamb", warmup_steps=2, partition="uniform",
                              timeout_s=30)


def _by_layer(result, job):
    """Every parameter of the run keyed by (layer, name), from one replica of each stage."""
    from chimera.runtime import stage_params_by_layer

    out = {}
    for state in result.states.values():
        for (_, stage), params in state.items():
            out.update(stage_params_by_layer(params, job.stage_layers[stage]))
    return out


@pytest.fixture(scope="module")
def full():
    """The uninterrupted 6-step run: per-step losses and parameters by layer."""
    job = compile_job(BASE)
    res = run_local(job, return_state=True)
    return [m["loss"] for m in res.metrics], _by_layer(res, job)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """A run of 3 steps that saves a checkpoint after its last step."""
    root = tmp_path_factory.mktemp("ck3")
    res = run_local(compile_job(BASE.with_flags(steps=3, checkpoint_dir=str(root))))
    return root, [m["loss"] for m in res.metrics]


def test_resume_is_bit_exact(full, three):
    root, first = three
    [ck] = complete(root)
    manifest = json.loads((ck / "manifest.json").read_text())
    assert ck.name == "step-00000003" and manifest["step"] == 3 and manifest["lr_schedule"]["last_epoch"] == 3
    job = compile_job(BASE.with_flags(resume=str(root)))
    assert job.first_step == 3 and job.resume.same_layout
    res = run_local(job, return_state=True)
    assert [m["step"] for m in res.metrics] == [3, 4, 5]
    assert first + [m["loss"] for m in res.metrics] == full[0]  # bitwise
    params = _by_layer(res, job)
    assert params.keys() == full[1].keys()
    assert all(torch.equal(params[k], full[1][k]) for k in params)


def test_resume_with_other_depth_and_schedule_repartitions(full, three):
    root, first = three
    job = compile_job(BASE.with_flags(schedule="1f1b", stages=4, resume=str(root)))
    assert not job.resume.same_layout and job.stage_layers != compile_job(BASE).stage_layers
    res = run_local(job, return_state=True)
    losses = first + [m["loss"] for m in res.metrics]
    assert max(abs(a - b) for a, b in zip(losses, full[0])) <= 1e-5
    params = _by_layer(res, job)
    assert max((params[k] - full[1][k]).abs().max().item() for k in params) <= 1e-5


def test_resume_with_other_width_continues_with_its_data(three):
    """Chimera W = 1 for 3 steps, then resumed as 1F1B with W = 2 (same global batch, the new layout's data): the sequential
    reference that switches layout at step 3 agrees within 1e-5."""
    from chimera.runtime.reference import train_sequential

    root, first = three
    job = compile_job(BASE.with_flags(schedule="1f1b", data_parallel=2, micro_batches=1, resume=str(root)))
    res = run_local(job, return_state=True)
    ref = train_sequential(compile_job(BASE), then=(3, job))
    losses = first + [m["loss"] for m in res.metrics]
    assert max(abs(a - b) for a, b in zip(losses, ref.losses)) <= 1e-5
    params = _by_layer(res, job)
    assert max((params[k] - ref.params[k]).abs().max().item() for k in params) <= 1e-5


def test_interrupted_write_keeps_the_last_good_checkpoint(full, tmp_path):
    # rank 0 is SIGKILLed while writing the checkpoint after step 4 (its data written, the manifest not yet)
    cfg = BASE.with_flags(checkpoint_dir=str(tmp_path), checkpoint_every=2, debug_kill_in_save=3)
    with pytest.raises(WorkerError):  # rank 0 exits with -9, or a peer reports the lost connection first
        run_local(compile_job(cfg))
    assert [p.name for p in complete(tmp_path)] == ["step-00000002"]
    assert partial_dir(tmp_path, 4).is_dir() and any(partial_dir(tmp_path, 4).iterdir())
    job = compile_job(BASE.with_flags(resume=str(tmp_path), checkpoint_dir=str(tmp_path), checkpoint_every=2))
    assert job.first_step == 2
    res = run_local(job, return_state=True)
    assert [m["loss"] for m in res.metrics] == full[0][2:]
    assert ["checkpoint_s" in m for m in res.metrics] == [False, True, False, True]  # the copy's time, when saved
    params = _by_layer(res, job)
    assert all(torch.equal(params[k], full[1][k]) for k in params)
    assert [p.name for p in complete(tmp_path)] == ["step-00000002", "step-00000004", "step-00000006"]
    assert not partial_dir(tmp_path, 4).exists()  # the stale write was removed before the workers started


def test_corrupt_or_foreign_checkpoints_are_refused(three, tmp_path):
    import shutil

    root, _ = three
    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    [ck] = complete(copy)
    with pytest.raises(ConfigError, match="another run .*fingerprint.*optimizer: checkpoint 'lamb', this run 'adamw'"):
        compile_job(BASE.with_flags(resume=str(copy), optimizer="adamw", seq_len=32))
    with pytest.raises(ConfigError, match="3 steps done and --steps is 3; raise --steps"):
        compile_job(BASE.with_flags(resume=str(copy), steps=3))
    shard = ck / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"__1_0.distcp is corrupt \(its SHA-256 differs"):
        compile_job(BASE.with_flags(resume=str(copy)))
    (ck / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        compile_job(BASE.with_flags(resume=str(copy)))


def test_sharded_optimizer_state_saves_and_resumes_bit_exact(full, three, tmp_path):
    """--shard-optimizer: each parameter's state is written by its owner; resumed sharded, unsharded from a sharded
    checkpoint, or sharded from an unsharded one, the run is bitwise the uninterrupted unsharded one."""
    res = run_local(compile_job(BASE.with_flags(steps=3, checkpoint_dir=str(tmp_path), shard_optimizer=True)))
    first = [m["loss"] for m in res.metrics]
    assert first == three[1]
    for root, shard in ((tmp_path, True), (tmp_path, False), (three[0], True)):
        job = compile_job(BASE.with_flags(resume=str(root), shard_optimizer=shard))
        res = run_local(job, return_state=True)
        assert first + [m["loss"] for m in res.metrics] == full[0], (root, shard)
        params = _by_layer(res, job)
        assert all(torch.equal(params[k], full[1][k]) for k in full[1]), (root, shard)

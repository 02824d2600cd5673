"""The same worker runtime under Ray actors: parity, failure reporting, clean-up, refusal before start."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.runtime import stage_params_by_layer, train_sequential
from chimera.util.cores import core_sets, usable_cores
from ray_launch.driver import RayJob, RunError
from ray_launch.recovery import run
from tests.conftest import alive_actors

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
BASE = TrainConfig.from_flags(model="bert-tiny", micro_batch_size=2, seq_len=16, steps=3, optimizer="adamw", timeout_s=60,
                   check_replicas=True, corpus="synthetic", partition="uniform")


def _wait_no_actors(ray, timeout=20.0):
    deadline = time.monotonic() + timeout
    while alive_actors(ray) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive_actors(ray)


def test_chimera_on_ray_equals_sequential(ray_session, tmp_path):
    cfg = BASE.with_flags(schedule="chimera", stages=4, micro_batches=4, model="gpt2-tiny", steps=4)
    job = compile_job(cfg)
    with RayJob(job) as ray_job:
        # three steps in one call per actor, the next call queued on the actors ahead of the driver
        records = list(ray_job.steps(range(cfg.training.steps), ahead=1, per_call=3))
        states = ray_job.states()
        nodes = {i["node_id"] for i in ray_job.infos}
        niceness = [os.getpriority(os.PRIO_PROCESS, i["pid"]) for i in ray_job.infos]  # Ray's default: 15
        cores = [os.sched_getaffinity(i["pid"]) for i in ray_job.infos]
        pinned = [i["cpus"] for i in ray_job.infos]
    assert niceness == [0] * 4
    sets = core_sets(usable_cores(), 4, job.run.threads)  # --cpu-affinity auto: where 4 workers fill the cores
    assert pinned == ([sorted(c) for c in sets] if sets else [None] * 4)
    assert cores == ([set(c) for c in sets] if sets else [set(usable_cores())] * 4)
    ref = train_sequential(job)
    for rec, r in zip(records, ref.losses):
        assert abs(rec["loss"] - r) <= 1e-6
    for state in states:
        for (_, stage), params in state.items():
            for k, v in stage_params_by_layer(params, job.stage_layers[stage]).items():
                assert (v - ref.params[k]).abs().max().item() <= 1e-5
    assert [r["step"] for r in records] == list(range(cfg.training.steps))
    assert len(states) == 4 and len(nodes) == 1
    assert _wait_no_actors(ray_session) == []


def test_run_writes_jsonl_metrics(ray_session, tmp_path):
    out = tmp_path / "m.jsonl"
    records = run(compile_job(BASE.with_flags(schedule="1f1b", stages=2, micro_batches=2, steps=2)), out=out, progress=False)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == records and [r["step"] for r in lines] == [0, 1]
    assert {"step", "loss", "step_time_s", "samples_per_s"} <= set(lines[0])
    assert _wait_no_actors(ray_session) == []


def test_stalled_worker_is_named_and_actors_are_gone(ray_session):
    # run() keeps the next step queued on the actors: the failure of step 0 is reported, the queued step dies
    cfg = BASE.with_flags(schedule="chimera", stages=2, micro_batches=2, steps=3, timeout_s=3, debug_stall=(1, 30.0))
    t0 = time.monotonic()
    with pytest.raises(RunError) as e:
        run(compile_job(cfg), progress=False)
    msg = str(e.value)
    assert "worker 0" in msg and "stalled" in msg and "micro-batch" in msg and "RECV" in msg
    assert time.monotonic() - t0 < 60
    # the hang grid: every worker's pending action on the validator's grid, and who waits for whom
    lines = msg[msg.index("what every worker waits on"):].splitlines()
    assert lines[1].split() == ["step", "w0", "w1"] and len(lines) > 5
    [marked] = [x for x in lines[1:] if ">" in x]
    assert ">u1RECV_F0<" in marked
    assert "worker 0: step 0, action 2 u1RECV_F0 (RECV_F, micro-batch 0) waits for worker 1" in msg
    assert "worker 1: step 0, not inside the action list" in msg  # asleep before its first action
    assert _wait_no_actors(ray_session) == []


def test_invalid_config_refused_before_any_actor(ray_session):
    before = len(alive_actors(ray_session))
    with pytest.raises(ConfigError, match="even number"):
        run(compile_job(BASE.with_flags(schedule="chimera", stages=3, micro_batches=3)), progress=False)
    assert len(alive_actors(ray_session)) == before


def test_too_few_resources_is_a_clear_error(ray_session):
    with pytest.raises(RunError, match="cluster has .* CPU but 16 workers need"):
        run(compile_job(BASE.with_flags(schedule="1f1b", stages=4, micro_batches=4, data_parallel=4, model="gpt2-tiny")),
            progress=False)
    assert _wait_no_actors(ray_session) == []


@pytest.mark.slow
def test_the_default_script_refuses_bad_flags_before_ray():
    """(The default job itself runs in CI as README.md's first block.)"""
    p = subprocess.run([sys.executable, "scripts/prof_steps_ray.py", "--stages", "3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "even number of --stages" in p.stderr and "Traceback" not in p.stderr
    assert "Started a local Ray" not in p.stderr  # refused before Ray started


def test_user_chain_on_ray_trains_like_local(ray_session):
    """The public API on Ray (ray_launch.train) and locally (chimera.train) train the same chain identically."""
    import torch
    from torch import nn

    import chimera
    import ray_launch

    def data(step, mb, rank):
        g = torch.Generator().manual_seed(step * 100 + mb * 10 + rank)
        x = torch.randn(4, 6, generator=g)
        return x, x.sum(1, keepdim=True)

    chain = chimera.LayerChain([lambda: nn.Linear(6, 16), nn.Tanh, lambda: nn.Linear(16, 1)], nn.functional.mse_loss,
                               data(0, 0, 0), name="mlp")
    flags = {"schedule": "chimera", "mode": "doubling", "stages": 2, "micro_batches": 4, "steps": 3, "optimizer": "sgd",
             "lr": 0.05}
    on_ray = [r["loss"] for r in ray_launch.train(chain, data, **flags)]
    local = [r["loss"] for r in chimera.train(chain, data, **flags)]
    assert on_ray == local and len(on_ray) == 3
    assert _wait_no_actors(ray_session) == []

"""Recovery on Ray: a worker actor SIGKILLed mid-run is replaced by a restart from the last checkpoint, and the
run ends bitwise where an uninterrupted run ends (the hang grid of a stall: tests/test_ray_runtime.py)."""

import json
import os
import signal
import threading
import time

import pytest
import torch

from chimera.checkpoint import complete
from chimera.compile import compile_job
from chimera.config import TrainConfig
from chimera.runtime import run_local
from chimera.runtime.checkpoint import load
from ray_launch.config import LaunchConfig
from ray_launch.recovery import run
from tests.conftest import alive_actors

pytestmark = pytest.mark.ray
# the delay model sleeps in every block: steps long enough (~0.1 s) to kill a worker in the middle of the run
CFG = TrainConfig.from_flags(model="delay", model_overrides={"fwd_s": 0.01}, schedule="chimera", stages=2, micro_batches=2, micro_batch_size=2,
                             steps=6, optimizer="adamw", partition="uniform", timeout_s=20, checkpoint_every=2)


def _worker_pids(ray):
    from ray._private.state import actors

    return [a["Pid"] for a in actors().values() if a["ActorClassName"] == "WorkerActor" and a["State"] == "ALIVE"]


def test_killed_worker_restarts_from_checkpoint_bitwise(ray_session, tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "m.jsonl"
    killed = []

    def kill_after_first_checkpoint():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            pids = _worker_pids(ray_session)
            if ck.is_dir() and complete(ck) and len(pids) == 2:
                os.kill(pids[-1], signal.SIGKILL)
                killed.append(pids[-1])
            time.sleep(0.05)

    threading.Thread(target=kill_after_first_checkpoint, daemon=True).start()
    records = run(compile_job(CFG.with_flags(checkpoint_dir=str(ck))), LaunchConfig(max_restarts=1), out=out,
                  progress=False)
    assert killed and [r["step"] for r in records] == list(range(6))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    [restart] = [x for x in lines if x.get("event") == "restart"]
    assert "died" in restart["error"] and restart["resumed_from_step"] >= 2
    assert restart["steps_rerun"] == restart["failed_at_step"] - restart["resumed_from_step"]
    assert sum(1 for x in lines if x.get("rerun")) == restart["steps_rerun"]
    # the uninterrupted run (local processes: the same numerics) ends in the same parameters and optimizer state
    run_local(compile_job(CFG.with_flags(checkpoint_dir=str(tmp_path / "ref"))))
    got, want = load(ck), load(tmp_path / "ref")
    keys = [k for k in want if not k.startswith("rng.")]
    assert complete(ck)[-1].name == "step-00000006" and sorted(keys) == sorted(k for k in got if "rng." not in k)
    assert all(torch.equal(got[k], want[k]) for k in keys)
    deadline = time.monotonic() + 20
    while alive_actors(ray_session) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_actors(ray_session) == []

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


#: worker 0 stalls this long before every step (fault injection, numerics unchanged): after the first checkpoint
#: (after step 1) the run has at least four stalls left, a window of >= 2 s in which the killer, polling Ray every
#: 50 ms, must land; a loaded machine can still make it miss (the run ends unkilled, or the kill lands after the last
#: step), and then the run is repeated once
STALL = (0, 0.5)


def _run_and_kill(ray, ck, out) -> tuple[list[dict], list[int]]:  # noqa: ANN001
    """The run, with a worker SIGKILLed once the first checkpoint is complete; its records and the killed pid."""
    killed, done = [], threading.Event()

    def kill_after_first_checkpoint():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed and not done.is_set():
            pids = _worker_pids(ray)
            if ck.is_dir() and complete(ck) and len(pids) == 2:
                os.kill(pids[-1], signal.SIGKILL)
                killed.append(pids[-1])
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    try:
        records = run(compile_job(CFG.with_flags(checkpoint_dir=str(ck), debug_stall=STALL)),
                      LaunchConfig(max_restarts=1), out=out, progress=False)
    finally:
        done.set()
        killer.join(timeout=30)
    return records, killed


@pytest.mark.timeout(300)
def test_killed_worker_restarts_from_checkpoint_bitwise(ray_session, tmp_path):
    for attempt in range(2):  # the kill must land inside the run (see STALL)
        ck, out = tmp_path / f"ck{attempt}", tmp_path / f"m{attempt}.jsonl"
        records, killed = _run_and_kill(ray_session, ck, out)
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        restarts = [x for x in lines if x.get("event") == "restart"]
        if killed and restarts:
            break
    assert killed and restarts, "the worker was not killed during the run, twice (see STALL)"
    assert [r["step"] for r in records] == list(range(6))
    [restart] = restarts
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

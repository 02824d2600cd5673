"""SIGTERM (what SLURM and Kubernetes send on preemption) to ``chimera train``: the steps in flight finish, a final
checkpoint is written, the run exits with code 75 saying how to continue, and ``--resume`` continues bit-exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chimera.checkpoint import complete
from chimera.compile import compile_job
from chimera.config import load as load_config
from chimera.runtime import run_local
from chimera.runtime.checkpoint import load
from ray_launch.command import PREEMPTED, TERMINATED, train_main
from ray_launch.preemption import Preemption, Terminated

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ray
CONFIG = """
[model]
name = "delay"
overrides = {fwd_s = 0.005}
[schedule]
stages = 2
micro_batches = 2
micro_batch_size = 2
partition = "uniform"
[training]
steps = 24
optimizer = "adamw"
warmup_steps = 5
"""


def _steps(metrics: Path) -> list[dict]:
    return [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []


def _start(tmp_path: Path, address: str, *flags: str) -> subprocess.Popen:
    """``chimera train`` on the session's cluster (joining it: no Ray of its own to start)."""
    (tmp_path / "run.toml").write_text(CONFIG)
    cmd = [sys.executable, "-m", "ray_launch.cli", "train", "--config", str(tmp_path / "run.toml"), "--run-dir",
           str(tmp_path / "rd"), "--no-progress", "--address", address, "--no-ship-code", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _after_steps(p: subprocess.Popen, metrics: Path, n: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while sum("step" in x for x in _steps(metrics)) < n:
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {n} steps within {timeout_s} s"
        time.sleep(0.02)


@pytest.mark.timeout(300)
def test_sigterm_leaves_a_checkpoint_and_resume_continues_bit_exactly(ray_cluster, tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "rd" / "metrics.jsonl"
    p = _start(tmp_path, ray_cluster.address, "--checkpoint-dir", str(ck), "--checkpoint-every", "1000")
    _after_steps(p, metrics, 3)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == PREEMPTED == 75, err[-3000:]
    lines = _steps(metrics)
    stopped = lines[-1]
    done = stopped["steps_done"]
    assert stopped["event"] == "stopped" and 3 <= done < 24
    assert [x["step"] for x in lines if "step" in x] == list(range(done))
    assert [c.name for c in complete(ck)] == [f"step-{done:08d}"] and stopped["checkpoint"] == str(complete(ck)[0])
    # continue as the message says, in this process (on the session's Ray)
    argv = err.split("continue with: chimera train ", 1)[1].split()
    assert argv[argv.index("--resume") + 1] == str(ck)
    assert train_main([*argv, "--no-progress"]) == 0
    lines = _steps(metrics)
    assert [x["step"] for x in lines if "step" in x] == list(range(24))  # every earlier line kept, none twice
    assert [x["from_step"] for x in lines if x.get("event") == "resume"] == [done]
    # the uninterrupted run: the same losses and the same final parameters and optimizer state, bit for bit
    cfg, _ = load_config(tmp_path / "run.toml")
    ref = run_local(compile_job(cfg.with_flags(checkpoint_dir=str(tmp_path / "ref"))))
    assert [x["loss"] for x in lines if "step" in x] == [r["loss"] for r in ref.metrics]
    got, want = load(ck), load(tmp_path / "ref")
    keys = [k for k in want if not k.startswith("rng.")]
    assert complete(ck)[-1].name == "step-00000024" and keys
    assert all(torch.equal(got[k], want[k]) for k in keys)


@pytest.mark.timeout(180)
def test_the_grace_period_running_out_stops_at_once(ray_cluster, tmp_path):
    metrics = tmp_path / "rd" / "metrics.jsonl"
    p = _start(tmp_path, ray_cluster.address, "--checkpoint-dir", str(tmp_path / "ck"), "--steps", "400",
               "--grace-period", "0.001")
    _after_steps(p, metrics, 2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == TERMINATED == 143, err[-3000:]
    assert "grace period (0.001 s, --grace-period) ran out" in err and "no checkpoint was written" in err
    assert not complete(tmp_path / "ck")


def test_a_second_sigterm_stops_at_once():
    stop = Preemption(60, can_save=True)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs in this thread, between two bytecodes
        assert stop.requested and 59 < stop.left_s() <= 60
        with pytest.raises(Terminated, match="a second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._on_term and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_sigterm_without_a_checkpoint_dir_stops_at_once():
    stop = Preemption(60, can_save=False)
    stop.install()
    try:
        with pytest.raises(Terminated, match="without --checkpoint-dir"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        stop.restore()

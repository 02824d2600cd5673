"""Loopback means loopback: a local run and the head of scripts/start_ray.sh listen on 127.0.0.1 only, and
shutdown.sh (run by sh, which is dash on Debian) stops every process of that head, the Ray client server
included, and nothing else.

The processes are found independently of the code under test: the run's (or the script's) process tree, the
processes whose command line names its temp dir, and those carrying a tag this test puts in their environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ray_launch.cluster import worker_env
from ray_launch.config import LaunchConfig
from tests.procs import TAG, Sampler, alive, family, head_env, listeners, not_loopback

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]


def test_local_run_listens_on_loopback_only(local_script_run):
    run = local_script_run  # the default script, local (a Ray of its own), under a stand-in nsys (tests/procs.py)
    assert run.returncode == 0, run.output[-3000:]
    assert any("WorkerActor.step" in t for t in run.titles), f"no sample during the steps: {run.titles}"
    assert any("WorkerActor" in who for who in run.listening.values())  # gloo's pairs were seen
    bad = not_loopback(run.listening)
    assert not bad, "listening beyond loopback during a local run:\n" + "\n".join(bad)


def test_comm_probe_on_the_driver_node_listens_on_loopback_only(ray_session):
    from ray_launch.commprobe import measure_comm_ray

    sampler = Sampler(os.getpid(), (), period_s=0.05)  # the session's Ray runs under this process
    sampler.start()
    try:  # a probe can be over between two samples on a loaded machine: again, up to three times, until seen
        for _ in range(3):
            comm = measure_comm_ray(2, "cpu", LaunchConfig(), sizes=(1024, 1 << 22), reps=6, timeout_s=60)
            if any("WorkerActor" in who for who in sampler.listening.values()):
                break
    finally:
        sampler.done.set()
        sampler.join(timeout=30)
    assert comm.where.startswith("ray: 1 node, 2 workers (pack): ")
    assert any("WorkerActor" in who for who in sampler.listening.values())  # gloo's pairs were seen
    bad = not_loopback(sampler.listening)
    assert not bad, "listening beyond loopback during a local communication probe:\n" + "\n".join(bad)


def test_local_workers_use_the_loopback_interface_unless_told(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert worker_env(LaunchConfig(), local=True)["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in worker_env(LaunchConfig(), local=False)  # across nodes: the node's address
    assert worker_env(LaunchConfig(env=("GLOO_SOCKET_IFNAME=eth1",)), local=True)["GLOO_SOCKET_IFNAME"] == "eth1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth2")
    assert worker_env(LaunchConfig(), local=True)["GLOO_SOCKET_IFNAME"] == "eth2"


def test_local_workers_import_the_drivers_packages_first(monkeypatch):
    import chimera
    import ray_launch

    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    roots = {str(Path(m.__file__).resolve().parents[1]) for m in (chimera, ray_launch)}
    path = worker_env(LaunchConfig(), local=True)["PYTHONPATH"].split(os.pathsep)
    assert set(path[:len(roots)]) == roots and path[-1] == "/somewhere"
    assert "PYTHONPATH" not in worker_env(LaunchConfig(), local=False)  # other nodes: --ship-code
    assert worker_env(LaunchConfig(env=("PYTHONPATH=/mine",)), local=True)["PYTHONPATH"] == "/mine"


def test_workers_run_at_niceness_0_unless_env_says_otherwise():
    """Ray would start the actors at niceness 15; a pipeline worker runs at 0 (tests/test_ray_runtime.py checks the
    actors' own priority)."""
    for local in (True, False):
        assert worker_env(LaunchConfig(), local=local)["RAY_worker_niceness"] == "0"
    assert worker_env(LaunchConfig(env=("RAY_worker_niceness=15",)))["RAY_worker_niceness"] == "15"


def test_start_ray_head_on_loopback_and_shutdown_stops_all_of_it(tmp_path):
    tag = uuid.uuid4().hex
    env = head_env(tmp_path, tag)
    state = tmp_path / "state.json"
    marks = (env["CHIMERA_RAY_TMP"], f"{TAG}={tag}")
    # a bystander naming the head's temp dir (like a `tail -f` of its logs): shutdown.sh must leave it alone
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", env["CHIMERA_RAY_TMP"]])
    try:
        p = subprocess.run([str(ROOT / "scripts" / "start_ray.sh")], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=240)
        assert p.returncode == 0, p.stderr[-3000:]
        head = {pid: q for pid, q in family([], marks).items() if pid != bystander.pid}
        assert any("ray.util.client.server" in " ".join(q.cmdline()) for q in head.values()), \
            "the Ray client server is not among the head's processes"
        listening = listeners(head)
        client_port = int(env["CHIMERA_RAY_CLIENT_PORT"])
        assert [ip for ip, port in listening if port == client_port], f"nothing on {client_port}: {listening}"
        bad = not_loopback(listening)
        assert not bad, "the head listens beyond loopback:\n" + "\n".join(bad)

        stop = subprocess.run(["sh", "shutdown.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert "stopped" in stop.stdout
        time.sleep(1)
        head.update({k: v for k, v in family([], marks).items() if k != bystander.pid})
        left = alive(head)
        assert not left, f"left running after shutdown.sh: {left}"
        assert bystander.poll() is None, "shutdown.sh stopped a process it did not start"
        assert not state.exists()
    finally:
        if state.exists():
            subprocess.run(["sh", "shutdown.sh"], cwd=ROOT, env=env, capture_output=True, timeout=120)
        bystander.kill()
        bystander.wait(timeout=30)
        shutil.rmtree(env["CHIMERA_RAY_TMP"], ignore_errors=True)

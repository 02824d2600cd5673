"""The shell scripts as a user runs them: they parse (bash -n / sh -n, and shellcheck when installed), the POSIX
ones run under sh (dash on Debian), bad input gets a message saying what to change, start_ray.sh fails loudly and
cleans up when Ray does not come up; prepare_wikipedia.py creates its output's folder."""

from __future__ import annotations

import bz2
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.procs import TAG, alive, family, head_env

ROOT = Path(__file__).resolve().parents[1]
MARKER = "CHIMERA_RAY_HEAD"
POSIX = ["shutdown.sh", "scripts/plot_cuda_timeline.sh", "scripts/slurm/ray_node.sh"]


def shell_scripts() -> list[str]:
    """Every tracked file that starts with a sh or bash shebang."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for f in files:
        path = ROOT / f
        if path.is_file():
            with open(path, "rb") as fh:
                first = fh.readline()
            if first.startswith(b"#!") and (first.rstrip().endswith((b"/sh", b" sh", b"bash"))):
                found.append(f)
    return found


def _shell(script: str) -> str:
    with open(ROOT / script, "rb") as fh:
        return "bash" if b"bash" in fh.readline() else "sh"


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_shell_script_is_found():
    assert {"shutdown.sh", "scripts/start_ray.sh", "scripts/plot_cuda_timeline.sh", "scripts/slurm/chimera.sbatch",
            "scripts/slurm/ray_node.sh"} <= set(shell_scripts())


@pytest.mark.parametrize("script", shell_scripts())
def test_shell_script_parses(script):
    p = _run([_shell(script), "-n", script])
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("script", POSIX)
def test_posix_scripts_are_sh(script):
    assert _shell(script) == "sh", f"{script} must start with #!/bin/sh: it is documented to run under sh (dash)"


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian: apt-get install -y shellcheck)")
    p = _run(["shellcheck", "--severity=warning", *shell_scripts()])
    assert p.returncode == 0, p.stdout + p.stderr


def test_shutdown_under_sh_without_a_head(tmp_path):
    env = {**os.environ, "CHIMERA_RAY_STATE": str(tmp_path / "none.json")}
    p = _run(["sh", "shutdown.sh"], env)
    assert p.returncode == 0 and "nothing to stop" in p.stdout, p.stderr
    p = _run(["sh", "shutdown.sh", "--bogus"], env)
    assert p.returncode == 2 and "usage: ./shutdown.sh [--cluster CONFIG.yaml]" in p.stderr


def test_start_ray_dry_run_binds_loopback_by_default(tmp_path):
    env = head_env(tmp_path, "dry")
    p = _run(["sh", "scripts/start_ray.sh", "--dry-run"], env)  # sh: the script re-executes itself under bash
    assert p.returncode == 0, p.stderr
    for part in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
                 "--min-worker-port=10002", "--max-worker-port=19999", f"--num-cpus={max(int(_run(['nproc']).stdout), 8)}",
                 f"--ray-client-server-port={env['CHIMERA_RAY_CLIENT_PORT']}"):
        assert part in p.stdout
    p = _run(["bash", "scripts/start_ray.sh", "--dry-run", "--bind", "lo"], env)
    assert "--node-ip-address=127.0.0.1" in p.stdout


def test_start_ray_dry_run_binds_a_given_interface(tmp_path):
    addrs = psutil.net_if_addrs()
    nic = next((n for n, a in addrs.items() if n != "lo" and any(x.family == socket.AF_INET for x in a)), None)
    if nic is None:
        pytest.skip("this machine has no interface with an IPv4 address besides lo")
    ip = next(x.address for x in addrs[nic] if x.family == socket.AF_INET)
    for how in (["--bind", nic], [f"--bind={ip}"]):
        p = _run(["bash", "scripts/start_ray.sh", "--dry-run", *how], head_env(tmp_path, "dry"))
        assert p.returncode == 0, p.stderr
        assert f"--node-ip-address={ip}" in p.stdout and f"--dashboard-host={ip}" in p.stdout
        assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1" in p.stdout


@pytest.mark.parametrize("change,message", [
    ({"CHIMERA_RAY_CLIENT_PORT": "10011"}, "CHIMERA_RAY_CLIENT_PORT=10011 lies in Ray's worker port range 10002-19999"),
    ({"CHIMERA_RAY_PORT": "63x"}, "CHIMERA_RAY_PORT must be a port (1-65535), got '63x'"),
    ({"CHIMERA_RAY_TMP": "relative/dir"}, "CHIMERA_RAY_TMP must be an absolute path"),
    ({"CHIMERA_RAY_CPUS": "0"}, "CHIMERA_RAY_CPUS must be a whole number >= 1"),
    ({"CHIMERA_RAY_BIND": "no-such-nic"}, "'no-such-nic' is neither an IPv4 address nor an interface"),
    ({"CHIMERA_RAY_BIND": "203.0.113.7"}, "203.0.113.7 is not an address of this machine"),
])
def test_start_ray_refuses_bad_settings(tmp_path, change, message):
    p = _run(["bash", "scripts/start_ray.sh"], {**head_env(tmp_path, "bad"), **change})
    assert p.returncode != 0 and message in p.stderr, p.stderr
    assert not (tmp_path / "state.json").exists()


@pytest.mark.ray
def test_start_ray_fails_loudly_and_stops_what_it_started(tmp_path):
    tag = uuid.uuid4().hex
    env = {**head_env(tmp_path, tag), "CHIMERA_RAY_WAIT": "5"}
    try:  # no dashboard: the job API never answers
        p = _run(["sh", "scripts/start_ray.sh", "--include-dashboard=false"], env, timeout=240)
        assert p.returncode == 1, p.stderr[-2000:]
        assert "Ray did not come up within 5 s: the job API at http://127.0.0.1:" in p.stderr
        assert "start_ray.sh: stopped" in p.stderr
        assert not (tmp_path / "state.json").exists()
        left = alive(family([], (env["CHIMERA_RAY_TMP"], f"{TAG}={tag}")))
        assert not left, f"start_ray.sh left running: {left}"
    finally:
        if (tmp_path / "state.json").exists():
            _run(["sh", "shutdown.sh"], env, timeout=120)
        shutil.rmtree(env["CHIMERA_RAY_TMP"], ignore_errors=True)


@pytest.mark.parametrize("env,expected", [
    ({"SLURM_GPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "8"}, "2 SLURM_GPUS_ON_NODE"),
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, "4 SLURM_GPUS_PER_NODE"),
    ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, "3 SLURM_GPUS_PER_NODE"),
    ({"CUDA_VISIBLE_DEVICES": "0,1,3"}, "3 CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "0 CUDA_VISIBLE_DEVICES"),
    ({"CHIMERA_GPUS_PER_NODE": "6", "SLURM_GPUS_ON_NODE": "2"}, "6 CHIMERA_GPUS_PER_NODE"),
])
def test_slurm_node_gpu_count(env, expected):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE", "CHIMERA_GPUS"))}
    p = _run(["sh", "scripts/slurm/ray_node.sh", "--gpus"], {**base, **env})
    assert p.returncode == 0 and p.stdout.strip() == expected, p.stderr


def test_slurm_node_refuses_a_bad_count():
    p = _run(["sh", "scripts/slurm/ray_node.sh", "--gpus"], {**os.environ, "CHIMERA_GPUS_PER_NODE": "four"})
    assert p.returncode == 2 and "the GPU count 'four' (from CHIMERA_GPUS_PER_NODE) is not a whole number" in p.stderr


def test_sbatch_says_what_is_missing(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CHIMERA_VENV"))}
    p = _run(["bash", "scripts/slurm/chimera.sbatch"], base)
    assert p.returncode == 1 and "not inside a SLURM job: submit it with sbatch" in p.stderr
    job = {**base, "SLURM_JOB_NODELIST": "node1", "SLURM_SUBMIT_DIR": str(ROOT)}
    p = _run(["bash", "scripts/slurm/chimera.sbatch"], {**job, "CHIMERA_VENV": str(tmp_path / "nowhere")})
    assert p.returncode == 1 and f"CHIMERA_VENV={tmp_path / 'nowhere'} has no bin/activate" in p.stderr
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    p = _run(["bash", "scripts/slurm/chimera.sbatch"], {**job, "CHIMERA_VENV": str(tmp_path / "bare")})
    assert p.returncode == 1 and "cannot import ray and chimera: set CHIMERA_VENV" in p.stderr


def _tiny_dump(path: Path) -> Path:
    text = ("'''Chimera''' trains networks in two directions. It keeps [[pipeline|pipelines]] busy.\n\n"
            "A second paragraph has two sentences. This is the second one.")
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
           f'<page><title>Chimera</title><ns>0</ns><id>1</id><revision><id>2</id><text>{text}</text></revision></page>\n'
           "</mediawiki>\n")
    path.write_bytes(bz2.compress(xml.encode()))
    return path


def test_prepare_wikipedia_creates_the_output_folder(tmp_path):
    dump = _tiny_dump(tmp_path / "tiny.xml.bz2")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_wikipedia.py"), str(dump), "-o",
                        "data/corpora/wiki.txt", "--no-progress"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = (tmp_path / "data" / "corpora" / "wiki.txt").read_text().splitlines()
    assert lines[0] == "Chimera trains networks in two directions." and len(lines) == 4
    assert not (tmp_path / "data" / "corpora" / "wiki.txt.partial").exists()


def test_prepare_wikipedia_output_folder_blocked_by_a_file(tmp_path):
    dump = _tiny_dump(tmp_path / "tiny.xml.bz2")
    (tmp_path / "data").write_text("a file, not a folder")
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_wikipedia.py"), str(dump), "-o",
                        str(tmp_path / "data" / "wiki.txt"), "--no-progress"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1
    assert f"cannot create its folder {tmp_path / 'data'} (a file is in the way); pick another output path" in p.stderr


def _state(path: Path, **fields: object) -> Path:
    path.write_text(json.dumps({"temp_dir": "/nonexistent/chimera-ray", **fields}))
    return path


def _wait_gone(pids: list[int], timeout_s: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = pids
    while left and time.monotonic() < deadline:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return left


def test_ray_head_stop_finds_orphans_by_session_and_spares_others(tmp_path):
    """A process that lost the marker and its parent is still the head's (same session, recorded by
    record-session); a bystander that leads its own session, or names the temp dir, is not."""
    marker = uuid.uuid4().hex
    state = _state(tmp_path / "state.json", marker=marker)
    pidfile = tmp_path / "orphan.pid"
    # the "head": a session leader with the marker, and an orphan without it (its parent subshell exits)
    head = subprocess.Popen(["setsid", "-w", "sh", "-c",
                             f"(env -u {MARKER} sleep 600 & echo $! > {pidfile}); exec sleep 600"],
                            env={**os.environ, MARKER: marker})
    bystander = subprocess.Popen(["setsid", "-w", "sleep", "600"])  # leads a session of its own
    try:
        deadline = time.monotonic() + 10
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline, "the orphan did not start"
            time.sleep(0.05)
        orphan = int(pidfile.read_text())
        p = _run([sys.executable, "scripts/ray_head.py", "record-session", str(state)])
        assert p.returncode == 0 and p.stdout.strip() == str(head.pid), p.stderr
        p = _run([sys.executable, "scripts/ray_head.py", "stop", str(state), "--grace", "6"])
        assert p.returncode == 0 and "stopped 2 process(es)" in p.stdout, p.stdout + p.stderr
        assert _wait_gone([head.pid, orphan]) == []
        assert bystander.poll() is None
        # a stale state whose session number now belongs to someone else's session: nothing is stopped
        stale = _state(tmp_path / "stale.json", marker=uuid.uuid4().hex, session=bystander.pid)
        p = _run([sys.executable, "scripts/ray_head.py", "stop", str(stale), "--grace", "3"])
        assert p.returncode == 0 and "stopped 0 process(es)" in p.stdout
        assert bystander.poll() is None
    finally:
        for proc in (head, bystander):
            proc.kill()
            proc.wait(timeout=30)
        if pidfile.exists() and pidfile.read_text().strip():  # the orphan, if the code under test missed it
            with contextlib.suppress(psutil.Error):
                orphan_proc = psutil.Process(int(pidfile.read_text()))
                if os.getsid(orphan_proc.pid) == head.pid:
                    orphan_proc.kill()

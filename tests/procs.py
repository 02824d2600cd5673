"""Processes and sockets for the tests of scripts and runs: find a run's processes independently of the code
under test (its process tree, its temp dir in command lines, a tag in environments), list what they listen on."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

TAG = "CHIMERA_TEST_LOOPBACK_TAG"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (outside Ray's worker port range: Linux hands out 32768 and up)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address (IPv4-mapped IPv6 included)."""
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def family(roots: list[int], marks: tuple[str, ...]) -> dict[int, psutil.Process]:
    """The processes ``roots``, those whose command line or environment holds one of ``marks``, and all their
    descendants (Ray's workers rename themselves over their environment, so the tree is needed too)."""
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter():
        try:
            text = " ".join(p.cmdline())
            with_env = text + " " + " ".join(f"{k}={v}" for k, v in p.environ().items())
        except psutil.Error:
            continue
        if p.pid in roots or any(m in with_env for m in marks):
            found[p.pid] = p
    for p in list(found.values()):
        try:
            found.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            continue
    found.pop(os.getpid(), None)
    return found


def listeners(procs: dict[int, psutil.Process]) -> dict[tuple[str, int], str]:
    """(address, port) -> 'title (pid N)' of every listening TCP socket of ``procs``."""
    out = {}
    for pid, p in procs.items():
        try:
            title = " ".join(p.cmdline()).strip()[:80] or p.name()
            for c in p.net_connections("inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.setdefault((c.laddr.ip, c.laddr.port), f"{title} (pid {pid})")
        except psutil.Error:
            continue
    return out


def not_loopback(listening: dict[tuple[str, int], str]) -> list[str]:
    """'who listens on address:port' for every listener of ``listening`` beyond loopback."""
    return [f"{who} listens on {ip}:{port}" for (ip, port), who in sorted(listening.items()) if not is_loopback(ip)]


def head_env(tmp_path: Path, tag: str) -> dict[str, str]:
    """Environment for scripts/start_ray.sh with its own temp dir, state file and free ports."""
    return {**os.environ, "CHIMERA_RAY_STATE": str(tmp_path / "state.json"),
            "CHIMERA_RAY_TMP": f"/tmp/chimera-test-{uuid.uuid4().hex[:8]}", "CHIMERA_RAY_PORT": str(free_port()),
            "CHIMERA_RAY_DASHBOARD_PORT": str(free_port()), "CHIMERA_RAY_AGENT_PORT": str(free_port()),
            "CHIMERA_RAY_CLIENT_PORT": str(free_port()), TAG: tag,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def alive(procs: dict[int, psutil.Process]) -> list[str]:
    """'name (pid N)' of every process of ``procs`` still running (zombies are done)."""
    left = []
    for pid, p in procs.items():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.name()} (pid {pid})")
        except psutil.Error:
            continue
    return left


class Sampler(threading.Thread):
    """Polls the listeners and titles of a run's processes until stopped."""

    def __init__(self, root: int, marks: tuple[str, ...], period_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.marks, self.period_s = root, marks, period_s
        self.listening: dict[tuple[str, int], str] = {}
        self.titles: set[str] = set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            procs = family([self.root], self.marks)
            for p in procs.values():
                try:
                    self.titles.add(" ".join(p.cmdline()).strip()[:80])
                except psutil.Error:
                    continue
            for key, who in listeners(procs).items():
                self.listening.setdefault(key, who)
            self.done.wait(self.period_s)


#: a stand-in for Nsight Systems' ``nsys``: logs its arguments, and ``nsys profile [opts] CMD`` runs CMD
NSYS_STUB = """#!/usr/bin/env bash
echo "$@" >> "$NSYS_STUB_LOG"
[ "$1" = "profile" ] || exit 0
shift
while [ $# -gt 0 ]; do case "$1" in --*) shift;; -*) shift 2;; *) break;; esac; done
exec "$@"
"""


@dataclass
class LocalRun:
    """What :func:`local_run` saw: the script's exit code and output, its processes' titles and listeners, the
    run's directory and the stand-in nsys's log (one line per call)."""

    returncode: int
    output: str
    run_dir: Path
    nsys_calls: list[str]
    titles: set[str] = field(default_factory=set)
    listening: dict[tuple[str, int], str] = field(default_factory=dict)


def local_run(tmp: Path, root: Path) -> LocalRun:
    """The default script as a user runs it locally (a Ray of its own, bert-tiny on two workers, the partition
    planned from a brief profile, 16 steps) with ``--nsys``, under the stand-in ``nsys`` of :data:`NSYS_STUB`, its
    processes (the run's tree, its Ray temp dir, a tag in their environment) sampled all along."""
    stub_dir = tmp / "bin"
    stub_dir.mkdir()
    (stub_dir / "nsys").write_text(NSYS_STUB)
    (stub_dir / "nsys").chmod(0o755)
    ray_tmp = tempfile.mkdtemp(prefix="chl-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    tag = uuid.uuid4().hex
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, TAG: tag, "NSYS_STUB_LOG": str(tmp / "nsys.log"),
           "PATH": f"{stub_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    cmd = [sys.executable, "scripts/prof_steps_ray.py", "--model", "bert-tiny", "--corpus", "synthetic", "--stages",
           "2", "--micro-batches", "2", "--seq-len", "16", "--steps", "16", "--nsys", "--no-progress",
           "--out", str(tmp / "metrics.jsonl")]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid, (ray_tmp, f"{TAG}={tag}"))
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        sampler.done.set()
        sampler.join(timeout=30)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    log = tmp / "nsys.log"
    return LocalRun(proc.returncode, out, tmp, log.read_text().splitlines() if log.exists() else [], sampler.titles,
                    sampler.listening)

"""Processes and sockets for the tests of scripts and runs: find a run's processes independently of the code
under test (its process tree, its temp dir in command lines, a tag in environments), list what they listen on."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import uuid
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

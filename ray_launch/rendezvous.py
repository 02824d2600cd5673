"""Where a Ray job's workers meet: a local run (every worker on the driver's node) stays on loopback.

torch's TCPStore, the default ``tcp://`` rendezvous, listens on every interface whatever host its URL names,
and takes no authentication; a local run therefore rendezvouses through a file in a private temp dir (as
``chimera.runtime.launch.run_local`` does) and its gloo pairs use the loopback interface. Across nodes the
workers rendezvous over TCP on the node address.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Sequence

import ray


def on_driver_node(node_of_rank: Sequence[str]) -> bool:
    """Whether every worker is placed on the driver's own Ray node (a local run)."""
    here = ray.get_runtime_context().get_node_id()
    return bool(node_of_rank) and all(n == here for n in node_of_rank)


def loopback_interface() -> str | None:
    """This machine's loopback interface (``lo`` on Linux), or None when it has none by that name."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def keep_on_loopback(env: dict[str, str]) -> dict[str, str]:
    """``env`` with GLOO_SOCKET_IFNAME set to the loopback interface, unless it is set already."""
    if "GLOO_SOCKET_IFNAME" not in env and (lo := loopback_interface()):
        return {**env, "GLOO_SOCKET_IFNAME": lo}
    return env


class FileRendezvous:
    """A ``file://`` init method in a fresh private temp dir (0700), removed by :meth:`close`."""

    def __init__(self) -> None:
        self.dir: str | None = tempfile.mkdtemp(prefix="chimera-rendezvous-")
        self.init_method = f"file://{self.dir}/store"

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> FileRendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

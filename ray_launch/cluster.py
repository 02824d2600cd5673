"""Joining Ray and reserving the workers: start a local Ray or join a cluster (failing fast with what to change),
the code and environment the workers get, and a placement group with one bundle per worker on the node the
placement policy chose (:mod:`ray_launch.placement`).

    started = connect(LaunchConfig(address="10.0.0.1:6379"), world=8)   # True: started here, shut down by the caller
    pg, node_of_rank = reserve(8, {"CPU": 1.0}, launch, workers=4, log=logger.info)
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group

import chimera
import ray_launch
from chimera.util.source import path_first
from ray_launch.config import LaunchConfig
from ray_launch.placement import PlacementError, assign, cluster_nodes, format_map
from ray_launch.rendezvous import keep_on_loopback

#: the packages a worker imports from the driver's copy: shipped to other nodes, first on local workers' path
OUR_PACKAGES = (Path(chimera.__file__).parent, Path(ray_launch.__file__).parent)


class RunError(RuntimeError):
    """The run failed; the message names the worker and what it was doing."""


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast with a clear message when host:port of ``address`` does not accept connections."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise RunError(f"--address {address!r} is not 'auto' or host:port (e.g. 10.0.0.1:6379)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RunError(f"cannot reach the Ray cluster at --address {address}: {e.strerror or e} (is `ray start --head` "
                       "running there and the port open? omit --address to run on a local Ray)") from None


def connect(launch: LaunchConfig, world: int) -> bool:
    """Connect this driver to Ray unless it already is: join ``launch.address`` (within its connect timeout) or
    start a local Ray on loopback with room for ``world`` workers. Returns whether Ray was started here (then the
    caller shuts it down)."""
    if ray.is_initialized():
        return False
    if not launch.address:
        ray.init(address="local", num_cpus=max(world, os.cpu_count() or 1), include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=True, runtime_env=job_runtime_env(launch))
        return True
    timeout = launch.connect_timeout_s
    _check_reachable(launch.address, min(10.0, timeout))
    errors: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=launch.address, log_to_driver=True, runtime_env=job_runtime_env(launch))
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=init, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive() or errors:
        why = f"{type(errors[0]).__name__}: {str(errors[0]).splitlines()[0]}" if errors else \
            f"no answer within {timeout:g} s"
        raise RunError(f"cannot connect to the Ray cluster at --address {launch.address}: {why} (is a Ray head "
                       "running there, with the same auth token? omit --address to run on a local Ray)")
    return False


def job_runtime_env(launch: LaunchConfig) -> dict[str, Any] | None:
    """Ship chimera's packages to every node (``py_modules``) when joining a cluster, unless told not to, and the
    user's own modules (``--py-modules``: what ``--chain`` imports) always."""
    ship = launch.ship_code if launch.ship_code is not None else bool(launch.address)
    ours = [str(d) for d in OUR_PACKAGES] if ship else []
    modules = ours + [str(Path(m).resolve()) for m in launch.py_modules]
    return {"py_modules": modules} if modules else None


#: Ray lowers its worker processes' priority to niceness 15 (``RAY_worker_niceness``) so that they yield to its own
#: daemons; a pipeline worker holds its slot for the whole job and sits on every other worker's critical path, so it
#: runs at 0, as a torchrun process does and as Ray runs its own job drivers (``--env RAY_worker_niceness=15``
#: restores Ray's default)
WORKER_NICENESS = "0"


def worker_env(launch: LaunchConfig, local: bool = False) -> dict[str, str]:
    """Environment of the workers: the driver's NCCL_*/GLOO_* variables, niceness :data:`WORKER_NICENESS`, and
    ``--env``. A ``local`` run's gloo uses the loopback interface unless GLOO_SOCKET_IFNAME is set
    (``ray_launch.rendezvous``), and its workers import the driver's chimera and ray_launch (their directories first
    on PYTHONPATH, unless ``--env`` sets it): a driver run from one checkout would otherwise start actors from
    whatever copy is installed."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_"))}
    env["RAY_worker_niceness"] = WORKER_NICENESS
    env.update(e.split("=", 1) for e in launch.env)
    if not local:
        return env
    path = path_first(*OUR_PACKAGES)
    if "PYTHONPATH" not in env and path is not None:
        env["PYTHONPATH"] = path
    return keep_on_loopback(env)


def reserve(world: int, bundle: dict[str, float], launch: LaunchConfig, workers: int, log: Any
            ) -> tuple[Any, list[str]]:
    """Place ``world`` workers by ``launch.placement`` (``workers`` per pipeline, for the map it logs) and reserve
    one ``bundle`` for each on its node; returns (placement group, node id of every rank)."""
    have = ray.cluster_resources()
    for res, amount in bundle.items():
        if have.get(res, 0) < amount * world:
            raise RunError(f"the Ray cluster has {have.get(res, 0):g} {res} but {world} workers need "
                           f"{amount * world:g}; lower --stages/--data-parallel or add nodes")
    timeout = launch.connect_timeout_s
    deadline = time.monotonic() + timeout
    while True:  # resources of a job that just ended are freed asynchronously: wait for them a while
        nodes = cluster_nodes("GPU" if "GPU" in bundle else "CPU")
        try:
            node_of_rank = assign(launch.placement, world, nodes)
            break
        except PlacementError as e:
            if time.monotonic() > deadline:
                raise RunError(f"{e} (waited {timeout:g} s)") from None
            time.sleep(0.5)
    log(format_map(node_of_rank, nodes, workers))
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK",
                         bundle_label_selector=[{"ray.io/node-id": nid} for nid in node_of_rank])
    try:
        ray.get(pg.ready(), timeout=timeout)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise RunError(f"could not reserve {world} x {bundle} within {timeout:g} s "
                       f"(available now: {ray.available_resources()})") from None
    return pg, node_of_rank

"""Communication profile of a Ray cluster, measured between workers placed the way training places them.

One :class:`ray_launch.actor.WorkerActor` per worker, on the nodes that ``--placement`` picks, one bundle each in
a placement group (as the driver does); they join a process group (gloo on CPU, NCCL on GPU) and run
:func:`chimera.profile.comm.comm_probe`::

    from ray_launch.commprobe import measure_comm_ray
    comm = measure_comm_ray(4, "cuda", LaunchConfig(address="auto"))
    comm.where          # "ray: 2 nodes, 4 workers (pack): worker 0 on 10.0.0.1 [a1b2c3d4], ..."

Without ``launch.address`` (and no Ray connected) a local Ray on loopback is started and shut down after.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from chimera.profile.comm import SIZES, fit_comm
from chimera.profile.format import CommProfile
from ray_launch.actor import WorkerActor
from ray_launch.cluster import connect, reserve, worker_env
from ray_launch.config import LaunchConfig
from ray_launch.driver import _gather
from ray_launch.rendezvous import FileRendezvous, on_driver_node

logger = logging.getLogger(__name__)


def measure_comm_ray(world: int, device: str = "cpu", launch: LaunchConfig | None = None, *,
                     sizes: Sequence[int] = SIZES, reps: int = 3, timeout_s: float = 120.0, log: Any = None
                     ) -> CommProfile:
    """p2p and allreduce costs between ``world`` Ray workers (one CPU, or one GPU each) placed by
    ``launch.placement``; every wait is bounded (``launch.connect_timeout_s`` to place, ``timeout_s`` to probe)."""
    if world < 2:
        raise ValueError(f"a communication probe needs at least 2 workers, got {world}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    launch = (launch or LaunchConfig()).check()
    log = log or (lambda msg: None)
    started = connect(launch, world)
    pg, actors = None, []
    rendezvous: FileRendezvous | None = None
    try:
        bundle = {"CPU": 1.0, "GPU": 1.0} if device == "cuda" else {"CPU": 1.0}
        pg, node_of_rank = reserve(world, bundle, launch, world, log)
        local = on_driver_node(node_of_rank)
        env = worker_env(launch, local=local)
        options = {"runtime_env": {"env_vars": env}} if env else {}
        actors = [WorkerActor.options(num_cpus=1, num_gpus=bundle.get("GPU", 0), **options,
                                      scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
                                      ).remote() for r in range(world)]
        if local:  # every worker on the driver's node: rendezvous through a file, no TCPStore socket
            rendezvous = FileRendezvous()
            init = rendezvous.init_method
        else:
            loopback = started or ray.util.get_node_ip_address() in ("127.0.0.1", "localhost")
            # the first call waits for the actor process to start (imports torch)
            host, port = _gather([actors[0].rendezvous_address.remote(loopback)], "rendezvous",
                                 launch.connect_timeout_s + timeout_s)[0]
            init = f"tcp://{host}:{port}"
        refs = [a.probe_comm.remote(r, world, init, device, tuple(sizes), reps, timeout_s)
                for r, a in enumerate(actors)]
        results = _gather(refs, "communication probe", launch.connect_timeout_s + 2 * timeout_s)
    finally:
        for a in actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(a, no_restart=True)
        if pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        if rendezvous is not None:
            rendezvous.close()
        if started and ray.is_initialized():
            ray.shutdown()
    return fit_comm(results, "nccl" if device == "cuda" else "gloo", describe(results, launch.placement))


def describe(results: Sequence[dict[str, Any]], placement: str) -> str:
    """``"ray: N nodes, W workers (placement): worker 0 on ADDRESS [node id], ..."``."""
    nodes = {r["node_id"] for r in results}
    workers = ", ".join(f"worker {i} on {r['address']} [{r['node_id'][:8]}]" for i, r in enumerate(results))
    return (f"ray: {len(nodes)} node{'s' if len(nodes) != 1 else ''}, {len(results)} workers ({placement}): "
            f"{workers}")


def probe_from_args(args: Any) -> CommProfile:
    """``chimera profile --comm ray``: ``--probe-workers`` Ray workers on ``--address`` (or a local Ray)."""
    return measure_comm_ray(args.probe_workers, args.device, LaunchConfig(address=args.address),
                            log=logger.info)

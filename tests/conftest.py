"""Shared fixtures: one local two-node Ray cluster for the whole session, on loopback, token auth left on.

Ray picks the machine's network address for its nodes unless told otherwise; the tests keep every Ray
process on 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray use the loopback address, as on a
laptop) so that nothing is sent beyond this machine. It must be set before Ray is imported.
"""

import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    """Two Ray nodes on this machine (4 CPUs each, custom resources ``node_a`` / ``node_b``); the driver
    is connected to it. Shut down (only by us) at the end of the session."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"node_a": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=4, resources={"node_b": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def local_script_run(tmp_path_factory):
    """One local run of the default script with ``--nsys`` under a stand-in nsys, sampled all along
    (:func:`tests.procs.local_run`): tests/test_loopback.py checks what its processes listen on,
    tests/test_timeline.py that its workers started under Nsight. A local Ray and its workers are most of either
    test's time, so they share one run."""
    from pathlib import Path

    from tests.procs import local_run

    return local_run(tmp_path_factory.mktemp("local-run"), Path(__file__).resolve().parents[1])


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """The session's Ray (the two-node cluster), for tests that only need a running Ray."""
    import ray

    return ray


def alive_actors(ray) -> list[str]:
    """Names of the classes of actors that are alive in the session's Ray."""
    from ray._private.state import actors

    return [a.get("ActorClassName", "") for a in actors().values() if a["State"] != "DEAD"]


def wait_idle(ray, timeout_s: float = 60.0) -> None:
    """Until every CPU of the session's cluster is free again: an ended job's resources are released
    asynchronously, and a placement decided meanwhile sees fewer free slots on the node it used."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the session's cluster still busy after {timeout_s:g} s: "
                               f"{ray.available_resources()} of {ray.cluster_resources()}")
        time.sleep(0.2)


def node_ids(ray) -> dict[str, str]:
    """Custom resource name (node_a / node_b) -> node id of the session cluster."""
    out = {}
    for n in ray.nodes():
        if n.get("Alive"):
            for res in ("node_a", "node_b"):
                if res in n["Resources"]:
                    out[res] = n["NodeID"]
    return out

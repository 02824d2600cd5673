"""Shared fixtures: one local Ray for the whole session (loopback, token auth left on)."""

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray started once for all Ray tests; shut down (only by us) at the end of the session."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    yield ray
    ray.shutdown()


def alive_actors(ray) -> list[str]:
    """Names of the classes of actors that are alive in the session's Ray."""
    from ray._private.state import actors

    return [a.get("ActorClassName", "") for a in actors().values() if a["State"] != "DEAD"]

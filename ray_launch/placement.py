"""Where the workers go: placement policies over the cluster's nodes, and per-node commands.

Policies (``--placement``):

* ``pack`` (default): consecutive ranks fill one node after another (largest free capacity first, the
  driver's node first among equals), so pipeline neighbours share a node and a D-stage pipeline crosses
  nodes as few times as possible.
* ``spread``: rank r goes to node r mod (number of nodes): every pipeline edge crosses nodes (for
  measuring the network, or spreading memory).
* ``stage-pairs``: ranks (0, 1), (2, 3), ... form pairs that always share a node; pairs go round-robin over
  the nodes: half of the pipeline edges stay inside a node while the load is spread.

Each worker's bundle is pinned to its node with the ``ray.io/node-id`` label selector, so the map printed
before training is the map that runs.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_launch.config import PLACEMENTS as POLICIES  # one list of policies: the config's


class PlacementError(RuntimeError):
    """The cluster cannot host the workers as asked; the message says what is missing."""


@dataclass(frozen=True)
class Node:
    """A live Ray node and how many workers it can take now."""

    node_id: str
    address: str
    slots: int


def cluster_nodes(resource: str) -> list[Node]:
    """Alive nodes with their free slots of ``resource`` (``CPU`` or ``GPU``), driver's node first."""
    try:
        free = ray._private.state.available_resources_per_node()
    except Exception:  # older/newer Ray: fall back to totals
        free = {}
    here = ray.get_runtime_context().get_node_id()
    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        slots = _slots(free.get(n["NodeID"], n.get("Resources", {})), resource)
        nodes.append(Node(n["NodeID"], n.get("NodeManagerAddress", "?"), slots))
    nodes.sort(key=lambda x: (x.node_id != here, -x.slots, x.node_id))
    return nodes


def capacity(resource: str) -> int:
    """Workers the alive nodes can host at most (their total slots of ``resource``, used or not): fewer than a
    job's workers means the job no longer fits, however long it waits."""
    return sum(_slots(n.get("Resources", {}), resource) for n in ray.nodes() if n.get("Alive"))


def _slots(res: dict[str, float], resource: str) -> int:
    """Workers ``res`` can host: its whole units of ``resource`` (a GPU worker also takes a CPU)."""
    slots = int(res.get(resource, 0.0) + 1e-9)
    return min(slots, int(res.get("CPU", 0.0) + 1e-9)) if resource == "GPU" else slots


def assign(policy: str, world: int, nodes: Sequence[Node]) -> list[str]:
    """Node id of every rank under ``policy``; raises :class:`PlacementError` if the workers do not fit."""
    if policy not in POLICIES:
        raise PlacementError(f"unknown --placement {policy!r}; allowed: {', '.join(POLICIES)}")
    total = sum(n.slots for n in nodes)
    if total < world:
        have = ", ".join(f"{n.address} ({n.node_id[:8]}): {n.slots}" for n in nodes) or "no live nodes"
        raise PlacementError(f"{world} workers need {world} free slots but the cluster has {total} ({have}); "
                             "lower --stages/--data-parallel, free resources or add nodes")
    left = {n.node_id: n.slots for n in nodes}
    order = [n.node_id for n in nodes]
    out: list[str] = []
    if policy == "pack":
        for nid in order:
            take = min(left[nid], world - len(out))
            out += [nid] * take
    elif policy == "spread":
        i = 0
        while len(out) < world:
            nid = order[i % len(order)]
            if left[nid] > 0:
                out.append(nid)
                left[nid] -= 1
            i += 1
    else:  # stage-pairs
        i = 0
        while len(out) < world:
            size = min(2, world - len(out))
            fits = [nid for nid in order[i % len(order):] + order[:i % len(order)] if left[nid] >= size]
            if not fits:  # no node has room for a whole pair: split it
                fits = [nid for nid in order if left[nid] > 0]
                size = 1
            nid = fits[0]
            out += [nid] * size
            left[nid] -= size
            i = order.index(nid) + 1
    return out


def format_map(node_of_rank: Sequence[str], nodes: Sequence[Node], workers: int) -> str:
    """``worker -> node`` table printed before training."""
    addr = {n.node_id: n.address for n in nodes}
    lines = ["worker -> node"]
    for r, nid in enumerate(node_of_rank):
        lines.append(f"  rank {r:3d} (group {r // workers}, position {r % workers}) -> {addr.get(nid, '?')} "
                     f"[{nid[:12]}]")
    return "\n".join(lines)


@ray.remote(num_cpus=0, max_retries=0)
def _run_on_node(commands: Sequence[str], timeout_s: float) -> list[tuple[str, int, str]]:
    env = {**os.environ, "CHIMERA_NODE_ID": ray.get_runtime_context().get_node_id()}
    out = []
    for cmd in commands:
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout_s, env=env)
        out.append((cmd, p.returncode, (p.stdout + p.stderr)[-2000:]))
        if p.returncode != 0:
            break
    return out


def run_pre_commands(commands: Sequence[str], timeout_s: float = 600.0) -> dict[str, list[tuple[str, int, str]]]:
    """Run ``commands`` (shell) once on every live node, in order; raise naming the node on failure.

    The commands see ``CHIMERA_NODE_ID`` (the Ray node id) in their environment.
    """
    if not commands:
        return {}
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = {n["NodeID"]: _run_on_node.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(list(commands), timeout_s)
        for n in nodes}
    results = {}
    for nid, ref in refs.items():
        try:
            res = ray.get(ref, timeout=timeout_s * len(commands) + 60)
        except Exception as e:
            raise PlacementError(f"--pre-cmd on node {nid[:12]} failed: {type(e).__name__}: {e}") from None
        for cmd, code, output in res:
            if code != 0:
                raise PlacementError(f"--pre-cmd {cmd!r} exited with {code} on node {nid[:12]}: {output.strip()[-500:]}")
        results[nid] = res
    return results

"""Across nodes: placement policies on a two-node cluster, parity across nodes, --pre-cmd once per node,
job submission to a loopback head, shutdown.sh, and clear errors for bad addresses."""

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from chimera.compile import compile_job
from chimera.config import TrainConfig
from chimera.runtime import stage_params_by_layer, train_sequential
from ray_launch.cluster import _check_reachable
from ray_launch.config import LaunchConfig
from ray_launch.driver import RayJob, RunError
from ray_launch.placement import Node, PlacementError, assign
from tests.conftest import node_ids, wait_idle

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
DELAY = TrainConfig.from_flags(model="delay", model_overrides={"num_blocks": 4, "fwd_s": 0.001}, schedule="chimera", stages=4,
                    micro_batches=4, micro_batch_size=2, data_parallel=2, steps=1, optimizer="sgd", timeout_s=60, partition="uniform")


def test_assign_policies_unit():
    nodes = [Node("A", "h", 4), Node("B", "w", 4)]
    assert assign("pack", 6, nodes) == ["A"] * 4 + ["B"] * 2
    assert assign("spread", 5, nodes) == ["A", "B", "A", "B", "A"]
    assert assign("stage-pairs", 8, nodes) == ["A", "A", "B", "B", "A", "A", "B", "B"]
    assert assign("stage-pairs", 3, [Node("A", "h", 1), Node("B", "w", 2)]) == ["B", "B", "A"]
    with pytest.raises(PlacementError, match="9 workers need 9 free slots but the cluster has 8"):
        assign("pack", 9, nodes)


def _nodes_of(job) -> list[str]:
    return [info["node_id"] for info in job.infos]


def _placed(policy: str, data_parallel: int, pre_cmd: tuple[str, ...] = ()) -> list[str]:
    """The node of every worker of a one-step DELAY job on two stages placed by ``policy``."""
    import ray

    wait_idle(ray)  # the free slots the policy reads are every slot of each node
    cfg = DELAY.with_flags(stages=2, micro_batches=2, data_parallel=data_parallel)
    with RayJob(compile_job(cfg), LaunchConfig(placement=policy, pre_cmd=pre_cmd), log=lambda m: None) as job:
        job.step(0)
        return _nodes_of(job)


@pytest.fixture(scope="module")
def stage_pairs_with_pre_cmd(ray_cluster, tmp_path_factory) -> tuple[list[str], list[str]]:
    """One job serves two tests: placed by stage-pairs (W = 2), with a --pre-cmd that leaves a marker named after
    the node it runs on. (The node of every worker, the node ids the markers name.)"""
    marker = tmp_path_factory.mktemp("markers")
    nodes = _placed("stage-pairs", 2, (f'touch "{marker}/$CHIMERA_NODE_ID.$$"',))
    return nodes, sorted(p.name.split(".")[0] for p in marker.iterdir())


@pytest.mark.parametrize("policy,data_parallel,expected", [
    ("pack", 3, ["node_a"] * 4 + ["node_b"] * 2),  # fills node_a's 4 slots, then spills
    ("stage-pairs", 2, ["node_a", "node_a", "node_b", "node_b"]),
])
def test_placement_policies_put_workers_on_expected_nodes(ray_cluster, request, policy, data_parallel, expected):
    import ray

    ids = node_ids(ray)
    if policy == "stage-pairs":  # the job test_pre_cmd_runs_once_per_node reads too
        nodes, _ = request.getfixturevalue("stage_pairs_with_pre_cmd")
    else:
        nodes = _placed(policy, data_parallel)
    assert nodes == [ids[n] for n in expected]


def test_chimera_halving_across_two_nodes_spread_equals_sequential(ray_cluster):
    import ray

    ids = node_ids(ray)
    cfg = TrainConfig.from_flags(model="bert-tiny", schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2,
                      seq_len=16, data_parallel=2, steps=3, optimizer="adamw", timeout_s=60,
                      check_replicas=True, corpus="synthetic", mode="halving", partition="uniform")
    with RayJob(compile_job(cfg), LaunchConfig(placement="spread"), log=lambda m: None) as job:
        records = [job.step(s) for s in range(cfg.training.steps)]
        states = job.states()
        # every pipeline edge crosses nodes, and each stage's four replicas span both
        assert _nodes_of(job) == [ids["node_a"], ids["node_b"]] * 2
    job = compile_job(cfg)
    ref = train_sequential(job)
    assert all(abs(r["loss"] - x) <= 1e-6 for r, x in zip(records, ref.losses))
    for state in states:
        for (_, stage), params in state.items():
            for k, v in stage_params_by_layer(params, job.stage_layers[stage]).items():
                assert (v - ref.params[k]).abs().max().item() <= 1e-5


def test_pre_cmd_runs_once_per_node(ray_cluster, stage_pairs_with_pre_cmd):
    import ray

    _, markers = stage_pairs_with_pre_cmd
    assert markers == sorted(node_ids(ray).values())  # one marker per node, no node twice


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_script(*args: str) -> tuple[int, str, float]:
    """The default script refused at connecting: (exit code, stderr, seconds it took)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "scripts/prof_steps_ray.py", "--model", "bert-tiny", "--stages", "2",
                        "--micro-batches", "2", "--steps", "1", "--corpus", "synthetic", "--no-progress", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stderr, time.monotonic() - t0


@pytest.fixture(scope="module")
def bad_addresses() -> dict[str, tuple[int, str, float]]:
    """Both refused runs of the script, started at once (most of each is Python's start-up, which overlaps on two
    cores): a port nobody listens on, and a socket that accepts TCP connections but never speaks Ray."""
    with socket.socket() as s, ThreadPoolExecutor(2) as pool:  # s accepts TCP connections, never speaks Ray
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        wrong = pool.submit(_run_script, "--address", f"127.0.0.1:{_free_port()}")
        silent = pool.submit(_run_script, "--address", f"127.0.0.1:{s.getsockname()[1]}", "--connect-timeout", "5")
        return {"wrong": wrong.result(), "silent": silent.result()}


def test_wrong_address_fails_fast(bad_addresses):
    code, err, took = bad_addresses["wrong"]
    assert code == 1 and "cannot reach the Ray cluster at --address 127.0.0.1:" in err
    assert took < 60
    with pytest.raises(RunError, match="is not 'auto' or host:port"):  # the same check, without a second process
        _check_reachable("not-an-address", 1.0)


def test_unresponsive_cluster_fails_within_the_connect_timeout(bad_addresses):
    code, err, took = bad_addresses["silent"]
    assert code == 1 and "cannot connect to the Ray cluster" in err and "no answer within 5 s" in err
    assert took < 60

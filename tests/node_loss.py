"""A lost node, run by tests/test_node_loss.py in a process of its own: a two-node loopback Ray cluster of this
script's making (never the session's), ``chimera train --max-restarts 1`` in it, and a whole node taken away (its
raylet SIGKILLed by PID, then the worker processes it had started) once the first checkpoint is written.

    python tests/node_loss.py OUT_DIR       # prints one JSON line: what every case returned

Cases: ``fits`` (D = 2 spread over both nodes; the node left has room for both workers: the same layout again) and
``refit`` (D = 4 packed two per node; the node left has room for two: re-partitioned onto two stages). Ray is told
to declare a node dead after four missed health checks, one a second (its default is ~15 s), to keep the test short.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import psutil  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from chimera.checkpoint import complete  # noqa: E402
from ray_launch.command import train_main  # noqa: E402

CONFIG = """
[model]
name = "delay"
overrides = {fwd_s = 0.01}
[schedule]
micro_batches = 4
micro_batch_size = 2
partition = "uniform"
[training]
steps = 8
optimizer = "adamw"
timeout_s = 20
[checkpoint]
every = 2
"""
# a dead node is declared after ~4 s (Ray's default: ~15 s): after the survivors' errors, so the driver finds the
# lost workers itself (they stop answering) and waits for Ray's verdict on their node
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4,
                 "health_check_initial_delay_ms": 0, "health_check_timeout_ms": 1000}


def take_node_away(node: ray._private.node.Node, ck: Path, log: list[str]) -> None:
    """Once ``ck`` holds a complete checkpoint: SIGKILL the node's raylet, then what it started (its workers)."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (ck.is_dir() and complete(ck)):
        time.sleep(0.02)
    children = raylet.children(recursive=True)
    raylet.kill()
    for c in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            c.send_signal(signal.SIGKILL)
    log.append(f"killed raylet {raylet.pid} and {len(children)} process(es) after {complete(ck)[-1].name}")


def case(name: str, out: Path, node: ray._private.node.Node, flags: list[str]) -> dict[str, object]:
    ck = out / f"{name}-ck"
    log: list[str] = []
    killer = threading.Thread(target=take_node_away, args=(node, ck, log), daemon=True)
    killer.start()
    t0 = time.monotonic()
    code = train_main(["--config", str(out / "run.toml"), "--checkpoint-dir", str(ck), "--run-dir", str(out / name),
                       "--max-restarts", "1", "--no-progress", *flags])
    killer.join(5)
    return {"code": code, "seconds": time.monotonic() - t0, "killed": log, "checkpoint": str(ck),
            "metrics": str(out / name / "metrics.jsonl")}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.toml").write_text(CONFIG)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "_system_config": HEALTH_CHECKS})
    try:
        lost = cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        result = {"fits": case("fits", out, lost, ["--stages", "2", "--placement", "spread"])}
        cluster.remove_node(lost, allow_graceful=False)  # its processes are gone: only the cluster's list keeps it
        lost = cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        result["refit"] = case("refit", out, lost, ["--stages", "4", "--placement", "pack"])
        print(json.dumps(result), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()

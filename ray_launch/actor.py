"""The Ray actor that hosts one pipeline worker (one GPU, or one CPU slot)."""

from __future__ import annotations

import io
import socket
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from chimera.job import Job
from chimera.profile.comm import comm_probe
from chimera.runtime import PipelineWorker, StepResult


@ray.remote(max_restarts=0, max_task_retries=0, concurrency_groups={"control": 1})
class WorkerActor:
    """Wraps :class:`chimera.runtime.PipelineWorker`; the driver calls setup, then step per iteration.

    Not restarted by Ray: a torch process group cannot take back one restarted member, so the driver restarts
    the whole group from the last checkpoint instead. ``pending`` runs in its own concurrency group, so it
    answers while a step is blocked.
    """

    def __init__(self) -> None:
        self.worker: PipelineWorker | None = None

    def rendezvous_address(self, loopback: bool) -> tuple[str, int]:
        """This node's address and a free TCP port for torch.distributed's rendezvous (called on rank 0)."""
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def clock(self) -> float:
        """This worker's monotonic clock (the clock of its timeline events on CPU)."""
        return time.perf_counter()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def setup(self, job: Job, rank: int, world: int, init_method: str) -> dict[str, Any]:
        self.worker = PipelineWorker(job, rank, world, init_method)
        info = self.worker.setup()
        info["node_id"] = self.node_id()
        return info

    def step(self, step: int) -> StepResult:
        assert self.worker is not None, "setup() first"
        return self.worker.train_step(step)

    def run_steps(self, steps: list[int]) -> list[StepResult]:
        """Run ``steps`` back to back in one call (no Ray task between them); their results in order."""
        assert self.worker is not None, "setup() first"
        return [self.worker.train_step(s) for s in steps]

    def drain(self) -> dict[int, tuple[float, str]]:
        """``--post-validate``: take the verdict of the step in flight now (every rank at once); those taken."""
        assert self.worker is not None, "setup() first"
        return self.worker.drain()

    def checkpoint(self, step: int) -> str:
        """Write a checkpoint of the state after ``step`` now (every rank at once); its directory."""
        assert self.worker is not None, "setup() first"
        return self.worker.save(step)

    @ray.method(concurrency_group="control")
    def pending(self) -> dict[str, Any] | None:
        """The step and the action this worker runs or waits on (None before setup)."""
        return self.worker.pending() if self.worker is not None else None

    def state(self) -> bytes:
        """Every stage replica's parameters (torch.save bytes), for parity checks."""
        assert self.worker is not None
        buf = io.BytesIO()
        torch.save(self.worker.state(), buf)
        return buf.getvalue()

    def probe_comm(self, rank: int, world: int, init_method: str, device: str, sizes: tuple[int, ...], reps: int,
                   timeout_s: float) -> dict[str, Any]:
        """Join a process group of ``world`` probe actors and run :func:`chimera.profile.comm.comm_probe`; its
        samples, with this worker's node id and address."""
        from datetime import timedelta

        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init_method, rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        try:
            samples = comm_probe(rank, world, dev, sizes, reps, timeout_s)
        finally:
            dist.destroy_process_group()
        return {**samples, "node_id": self.node_id(), "address": ray.util.get_node_ip_address()}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

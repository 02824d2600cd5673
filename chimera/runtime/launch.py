"""Run a pipeline job without Ray: one ``torch.multiprocessing`` process per worker on this machine.

Used by the runtime's own tests and by anyone who wants the runtime without a cluster::

    result = run_local(TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=4, steps=3))
    result.metrics[-1]["loss"]

The job travels to the workers pickled with cloudpickle, so a user's chain and data (lambdas, functions of the
main script) need no import in the workers, and the workers never run the main script again.

The Ray driver (``ray_launch.driver``) shares :func:`summarize_step` with this launcher.
"""

from __future__ import annotations

import contextlib
import io
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing as mp

from chimera.config import TrainConfig
from chimera.job import Job
from chimera.runtime.checkpoint import remove_partial
from chimera.runtime.worker import PipelineWorker, StepResult


class WorkerError(RuntimeError):
    """A worker failed; the message names it and carries its error."""


def summarize_step(cfg: TrainConfig, results: list[StepResult]) -> dict[str, Any]:
    """One metrics record from all workers' results of one step."""
    by_stage: dict[int, set[str]] = {}
    for r in results:
        for (_, stage), digest in r.digests.items():
            by_stage.setdefault(stage, set()).add(digest)
    diverged = sorted(s for s, d in by_stage.items() if len(d) > 1)
    if diverged:
        raise WorkerError(f"step {results[0].step}: the replicas of stage(s) {diverged} are no longer bitwise "
                          "identical (gradient sync or optimizer differs between replicas)")
    count = sum(r.loss_count for r in results)
    step_time = max(r.step_time_s for r in results)
    s = cfg.schedule
    samples = s.micro_batches * s.micro_batch_size * s.data_parallel
    payloads: dict[int, int] = {}
    for r in results:
        for size, n in r.payloads.items():
            payloads[size] = payloads.get(size, 0) + n
    return {
        "step": results[0].step,
        "loss": sum(r.loss_sum for r in results) / max(1, count),
        "step_time_s": step_time,
        "samples_per_s": samples / step_time if step_time > 0 else float("inf"),
        "grad_norm": max(r.grad_norm for r in results),
        "microbatch_losses": count,
        "comm_payload": cfg.profiling.comm_payload,
        "training_result": cfg.is_training_result,
        "comm_bytes": sum(size * n for size, n in payloads.items()),
        "comm_messages": sum(payloads.values()),
        "payload_sizes": {str(k): v for k, v in sorted(payloads.items())},
        **({"memory_peak_bytes": [r.memory for r in sorted(results, key=lambda r: r.rank)]}
           if results[0].memory else {}),
        **({"swap_bytes": [r.swap_bytes for r in sorted(results, key=lambda r: r.rank)]}
           if cfg.training.offload != "none" else {}),
        **({"checkpoint_s": max(r.checkpoint_s for r in results)} if any(r.checkpoint_s for r in results) else {}),
        "gc_s": max(r.gc_s for r in results),
    }


@dataclass
class LocalResult:
    """Metrics per step, events (when profiling), and (on request) every rank's final parameters."""

    metrics: list[dict[str, Any]]
    events: list[Any] = field(default_factory=list)
    states: dict[int, Any] = field(default_factory=dict)


def _worker_main(packed: bytes, rank: int, world: int, init: str, return_state: bool, out: Any) -> None:
    worker = None
    try:
        job: Job = cloudpickle.loads(packed)
        worker = PipelineWorker(job, rank, world, init)
        worker.setup()
        for step in range(job.first_step, job.cfg.training.steps):
            out.put(("step", rank, worker.train_step(step)))
        if return_state:  # as bytes: tensors shared by fd die with this process before the parent reads them
            buf = io.BytesIO()
            torch.save(worker.state(), buf)
            out.put(("state", rank, buf.getvalue()))
        out.put(("done", rank, None))
    except BaseException as e:  # report every failure to the parent, then exit
        out.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.close()


def forkserver_context() -> Any:
    """A forkserver that has imported torch, chimera and the transformer presets once (several seconds), so that
    workers start in well under a second."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "chimera.runtime.worker", "chimera.models.bert", "chimera.models.gpt2"])
    return ctx


@contextlib.contextmanager
def main_not_rerun() -> Iterator[None]:
    """While processes start: hide the main script from multiprocessing, which would otherwise run it again in
    every worker (a script without an ``if __name__ == "__main__"`` guard would start training there too). The
    job needs nothing from it: cloudpickle carried its functions by value."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class LocalProcesses:
    """Processes forked from the preloaded forkserver, one per argument tuple, each called as
    ``target(*args, queue)``; a context manager that starts them with the main script hidden and, on exit, joins
    them (terminating any still alive). :meth:`messages` yields what they put on the queue until told to stop,
    raising ``error`` when one died without a word or the deadline passed (``name``: what a process is called in
    those messages, e.g. ``"worker"``).

        with LocalProcesses(_main, [(0,), (1,)], ProfileError, "probe process") as procs:
            for msg in procs.messages(60, waiting=lambda: "process 1"):
                ...
    """

    def __init__(self, target: Any, args: list[tuple[Any, ...]], error: type[Exception], name: str) -> None:
        ctx = forkserver_context()
        self.queue = ctx.Queue()
        self.procs = [ctx.Process(target=target, args=(*a, self.queue), daemon=True) for a in args]
        self.error, self.name = error, name
        self.finished = False

    def __enter__(self) -> LocalProcesses:
        with main_not_rerun():
            for p in self.procs:
                p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.join(timeout=5 if self.finished else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)

    def messages(self, deadline_s: float, waiting: Any) -> Iterator[Any]:
        """Messages until the caller stops; ``waiting()`` names what is still awaited (for the deadline's error)."""
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                yield self.queue.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise self.error(f"{self.name} {dead[0]} exited with code {self.procs[dead[0]].exitcode}"
                                     ) from None
                if time.monotonic() > deadline:
                    raise self.error(f"no answer within {deadline_s:.0f} s; still waiting for {waiting()}") from None


def run_local(job: Job | TrainConfig, *, return_state: bool = False, timeout_s: float | None = None) -> LocalResult:
    """Run a job with one process per worker (forked from a preloaded forkserver); raise :class:`WorkerError` if
    any fails. A config is checked first."""
    job = job if isinstance(job, Job) else job.check()
    cfg, t = job.cfg, job.cfg.training
    world = job.world_size
    packed = cloudpickle.dumps(job)
    remove_partial(t.checkpoint_dir)
    limit = timeout_s if timeout_s is not None else t.timeout_s * (t.steps + 2) + 120
    steps: dict[int, list[StepResult]] = {}
    states: dict[int, Any] = {}
    done: set[int] = set()
    with tempfile.TemporaryDirectory() as tmp:
        args = [(packed, r, world, f"file://{tmp}/rendezvous", return_state) for r in range(world)]
        with LocalProcesses(_worker_main, args, WorkerError, "worker") as procs:
            for kind, rank, payload in procs.messages(limit, lambda: f"workers {sorted(set(range(world)) - done)}"):
                if kind == "error":
                    raise WorkerError(f"worker {rank} failed: {payload}")
                if kind == "step":
                    steps.setdefault(payload.step, []).append(payload)
                elif kind == "state":
                    states[rank] = torch.load(io.BytesIO(payload))
                else:
                    done.add(rank)
                    if len(done) == world:
                        procs.finished = True
                        break
    metrics = [summarize_step(cfg, steps[s]) for s in sorted(steps)]
    events = [e for s in sorted(steps) for r in steps[s] for e in r.events]
    return LocalResult(metrics, events, states)

"""Run a pipeline job without Ray: one ``torch.multiprocessing`` process per worker on this machine.

Used by the runtime's own tests and by anyone who wants the runtime without a cluster::

    result = run_local(compile_job(TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=4, steps=3)))
    result.metrics[-1]["loss"]

The job travels to the workers pickled with cloudpickle, so a user's chain and data (lambdas, functions of the
main script) need no import in the workers, and the workers never run the main script again.

The Ray driver (``ray_launch.driver``) shares :func:`summarize_step` with this launcher.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch

from chimera.checkpoint import due, remove_partial, step_dir
from chimera.job import Job
from chimera.runtime.worker import PipelineWorker, StepResult
from chimera.util.processes import LocalProcesses


class WorkerError(RuntimeError):
    """A worker failed; the message names it and carries its error."""


def summarize_step(job: Job, results: list[StepResult]) -> dict[str, Any]:
    """One metrics record from all workers' results of one step. ``lr``: the learning rate of the step's update;
    ``tokens_per_s``: ``samples_per_s`` times the token positions of a sample (padding included;
    :meth:`~chimera.models.LayerChain.tokens_per_sample`), None for a model whose input has no token ids."""
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
    samples = job.layout.samples
    payloads: dict[int, int] = {}
    groups: dict[str, int] = {}
    for r in results:
        for size, n in r.payloads.items():
            payloads[size] = payloads.get(size, 0) + n
        for name, n in r.group_ops.items():
            groups[name] = groups.get(name, 0) + n
    per_s = samples / step_time if step_time > 0 else float("inf")
    tokens = job.chain.tokens_per_sample()
    return {
        "step": results[0].step,
        "loss": sum(r.loss_sum for r in results) / max(1, count),
        "lr": results[0].lr,
        "step_time_s": step_time,
        "samples_per_s": per_s,
        "tokens_per_s": per_s * tokens if tokens is not None else None,
        "grad_norm": max(r.grad_norm for r in results),  # post-validated: set by Verdicts when its verdict comes
        "microbatch_losses": count,
        "comm_payload": job.run.comm_payload,
        "training_result": job.run.is_training_result,
        "comm_bytes": sum(size * n for size, n in payloads.items()),
        "comm_messages": sum(payloads.values()),
        "payload_sizes": {str(k): v for k, v in sorted(payloads.items())},
        "group_ops": dict(sorted(groups.items())),
        **({"memory_peak_bytes": [r.memory for r in sorted(results, key=lambda r: r.rank)]}
           if results[0].memory else {}),
        **({"swap_bytes": [r.swap_bytes for r in sorted(results, key=lambda r: r.rank)]}
           if job.offload.optimizer else {}),
        **({"checkpoint_s": max(r.checkpoint_s for r in results)} if any(r.checkpoint_s for r in results) else {}),
        **({"checkpoint": str(step_dir(job.checkpoint.dir, results[0].step + 1))}
           if job.checkpoint.dir and due(results[0].step, job.checkpoint.every, job.run.steps) else {}),
        "gc_s": max(r.gc_s for r in results),
        **({"_verdicts": agreed_verdicts(r.verdicts for r in results), "repeated": max(r.repeated for r in results)}
           if job.run.post_validate else {}),
    }


def agreed_verdicts(per_worker: Iterable[dict[int, tuple[float, str]]]) -> dict[int, tuple[float, str]]:
    """The verdicts the workers took in one call, by step (one global norm: they agree)."""
    out: dict[int, tuple[float, str]] = {}
    for verdicts in per_worker:
        for step, (norm, outcome) in verdicts.items():
            seen = out.setdefault(step, (norm, outcome))
            if seen[1] != outcome:
                raise WorkerError(f"step {step}: the workers' post-validations disagree ({seen[1]}, {outcome})")
    return out


class Verdicts:
    """Post-validated steps (``--post-validate``) end without their verdict, which the next step takes: this holds
    each step's record until its verdict arrives, then fills in ``grad_norm`` and ``update`` (kept, redone,
    skipped) and releases the records in step order. A record whose verdict never came (a run stopped between two
    steps; its checkpoint drains it) is released by :meth:`rest` with ``update`` "unvalidated"."""

    def __init__(self, job: Job) -> None:
        self.on = job.run.post_validate
        self.held: dict[int, tuple[dict[str, Any], Any]] = {}
        self.known: dict[int, tuple[float, str]] = {}

    def add(self, record: dict[str, Any], item: Any) -> list[Any]:
        """Take one step's ``record`` (and the ``item`` that carries it); return the items now complete."""
        if not self.on:
            return [item]
        self.known.update(record.pop("_verdicts", {}))
        self.held[record["step"]] = (record, item)
        return self._release()

    def settle(self, verdicts: dict[int, tuple[float, str]]) -> list[Any]:
        """Take verdicts that came without a step (the workers drained); return the items now complete."""
        self.known.update(verdicts)
        return self._release()

    def _release(self) -> list[Any]:
        out = []
        for step in sorted(self.held):
            if step not in self.known:
                break
            rec, it = self.held.pop(step)
            rec["grad_norm"], rec["update"] = self.known.pop(step)
            out.append(it)
        return out

    def rest(self) -> list[Any]:
        """The items still held, marked unvalidated."""
        out = []
        for step in sorted(self.held):
            rec, it = self.held.pop(step)
            rec["update"] = "unvalidated"
            out.append(it)
        return out


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
        for step in range(job.first_step, job.run.steps):
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


def local_steps(job: Job, *, return_state: bool = False, timeout_s: float | None = None
                ) -> Iterator[tuple[str, Any]]:
    """Run a compiled job with one process per worker (forked from a preloaded forkserver), yielding
    ``("step", (record, results))`` as each step completes on every worker and, with ``return_state``, finally
    ``("states", {rank: stage parameters})``; raise :class:`WorkerError` when one fails."""
    t = job.run
    world = job.world_size
    if t.device == "cuda" and torch.cuda.device_count() < world:
        raise WorkerError(f"--device cuda runs one worker per GPU (NCCL refuses two ranks on one device): {world} "
                          f"workers, {torch.cuda.device_count()} GPU(s) visible here; lower --stages x --data-parallel "
                          "or run where more GPUs are visible")
    packed = cloudpickle.dumps(job)
    remove_partial(job.checkpoint.dir)
    limit = timeout_s if timeout_s is not None else t.timeout_s * (t.steps + 2) + 120
    steps: dict[int, list[StepResult]] = {}
    verdicts = Verdicts(job)
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
                    if len(steps[payload.step]) == world:
                        results = steps.pop(payload.step)
                        record = summarize_step(job, results)
                        for item in verdicts.add(record, (record, results)):
                            yield "step", item
                elif kind == "state":
                    states[rank] = torch.load(io.BytesIO(payload))
                else:
                    done.add(rank)
                    if len(done) == world:
                        procs.finished = True
                        break
    for item in verdicts.rest():
        yield "step", item
    if return_state:
        yield "states", states


def run_local(job: Job, *, return_state: bool = False, timeout_s: float | None = None) -> LocalResult:
    """Run a compiled job with one process per worker (:func:`local_steps`); every record, the events, and with
    ``return_state`` every rank's final stage parameters."""
    out = LocalResult([])
    for kind, payload in local_steps(job, return_state=return_state, timeout_s=timeout_s):
        if kind == "step":
            record, results = payload
            out.metrics.append(record)
            out.events += [e for r in results for e in r.events]
        else:
            out.states = payload
    return out

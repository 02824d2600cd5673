"""The worker: one process that executes one worker's lowered action list, step after step.

Usage (any launcher: Ray actors, ``torch.multiprocessing``, torchrun)::

    w = PipelineWorker(job, rank=r, world_size=n, init_method="tcp://10.0.0.1:29500")
    w.setup()
    for step in range(job.first_step, job.run.steps):
        result = w.train_step(step)
    w.close()

Set-up joins the process group and builds the parts: the communicator, the stage replicas and their optimizer
(:class:`StageState`), the compute handlers (:class:`StageCompute`), the communication batches and the
executor, whose table maps every action kind to its handler. A step is a fresh :class:`StepState` run through
the executor.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chimera.job import Job
from chimera.offload.store import HostStore
from chimera.runtime.batches import CommBatches
from chimera.runtime.checkpoint import Checkpointer
from chimera.runtime.comm import Communicator
from chimera.runtime.compute import StageCompute
from chimera.runtime.executor import Executor, segments
from chimera.runtime.handlers import handlers_for, register_handler
from chimera.runtime.ledger import MemoryLedger
from chimera.runtime.post_validate import PostValidation
from chimera.runtime.stage_state import StageState, tied_ranks
from chimera.runtime.step_state import StepState
from chimera.schedule import Action, Kind
from chimera.timeline import Event
from chimera.timeline.recorder import EventRecorder
from chimera.util.cores import host_id, pin_worker
from chimera.util.host_memory import StepCollector, keep_freed_memory
from chimera.util.source import check_same_source


@dataclass
class StepResult:
    """What one worker reports for one step."""

    step: int
    rank: int
    loss_sum: float
    loss_count: int
    step_time_s: float
    grad_norm: float
    events: list[Event] = field(default_factory=list)
    digests: dict[tuple[str, int], str] = field(default_factory=dict)
    payloads: dict[int, int] = field(default_factory=dict)  # bytes per message/allreduce -> how many
    memory: dict[str, int] = field(default_factory=dict)  # peak bytes held and its breakdown (--profile-memory)
    swap_bytes: int = 0  # bytes moved between host and device (--offload)
    checkpoint_s: float = 0.0  # seconds the step was held by saving a checkpoint (a copy; the write runs behind)
    gc_s: float = 0.0  # seconds of Python garbage collection after the step (--python-gc step), in step_time_s
    group_ops: dict[str, int] = field(default_factory=dict)  # process group -> operations posted on it
    lr: float = 0.0  # the learning rate of the step's update
    # --post-validate: the verdicts taken in this call, step -> (global norm, kept / redone / skipped): the previous
    # step's, and the step's own where it ends drained (the run's last step, a checkpoint's)
    verdicts: dict[int, tuple[float, str]] = field(default_factory=dict)
    repeated: int = 0  # --post-validate: runs of this step repeated (its previous step rolled back after it began)
    ended_s: float = 0.0  # CLOCK_MONOTONIC when the step ended here (one clock for the processes of a host)


class PipelineWorker:
    """Executes the lowered actions of global rank ``rank`` (worker ``rank % D`` of group ``rank // D``)."""

    def __init__(self, job: Job, rank: int, world_size: int, init_method: str) -> None:
        if world_size != job.world_size:
            raise ValueError(f"world size {world_size} does not match the job ({job.world_size} workers)")
        self.job = job
        self.run = job.run
        self.rank = rank
        self.world_size = world_size
        self.init_method = init_method
        self.worker = rank % job.schedule.workers
        self.dp_rank = rank // job.schedule.workers
        self.name = f"worker {rank} (group {self.dp_rank}, position {self.worker})"

    def setup(self) -> dict[str, Any]:
        """Join the process group; build the communicator, stage replicas, handlers and executor."""
        check_same_source(self.job.source, self.name)
        t, sched = self.run, self.job.schedule
        if t.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"{self.name}: --device cuda but no GPU is visible to this worker")
            # one GPU per worker (NCCL refuses two ranks on one device): Ray shows each actor its own GPU only;
            # local processes share the visible ones, by LOCAL_RANK (torchrun) or by rank
            index = int(os.environ.get("LOCAL_RANK", self.rank)) % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        else:
            self.device = torch.device("cpu")
            keep_freed_memory()
        torch.set_num_threads(t.threads)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", init_method=self.init_method,
                                rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=t.timeout_s))
        self.cpus = self._pin() if self.device.type == "cpu" and t.cpu_affinity == "auto" else None
        host_stages = [s for s in range(sched.stages) if self.job.offload.gradients_at(s)]
        self.comm = Communicator(sched, self.rank, tied_ranks(self.job).values(), t.timeout_s, self.name, t.comm_payload,
                                 host_stages, t.p2p, _largest_message(self.job), t.p2p_spin_s)
        self.stages = StageState(self.job, self.worker, self.dp_rank, self.device, self.comm)
        self.post = PostValidation(self.stages) if t.post_validate else None
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if t.amp and self.device.type == "cuda"
                    else nullcontext())
        self.budget = self.job.memory_budget
        account = self.job.timeline.memory or self.budget is not None
        self.compute = StageCompute(self.job, self.stages.modules, self.worker, self.dp_rank, self.device, autocast,
                                    keep_saved=account, store=self.stages.host)
        segs = segments(sched.actions[self.worker])
        self.batches = CommBatches(self.comm, self.job, self.worker, segs, self.device, self._what)
        self.batches.while_waiting = self._loader(segs)
        handlers = handlers_for(self, {a.kind for a in sched.actions[self.worker]})
        self.executor = Executor(segs, handlers, self.batches, self.name)
        self._seg_starts = [sum(len(x) for x in segs[:k]) for k in range(len(segs))]
        self.step_now = self.job.first_step
        self.failed_step: int | None = None
        self.ledger = MemoryLedger(self.stages, self.batches, self.post, self.compute) if account else None
        timeline = self.job.timeline
        self.recorder = (EventRecorder(self.rank, self.device, sched.bidirectional)
                         if timeline.profile or timeline.nsys else None)
        self.checkpoints = (Checkpointer(self.job, self.rank, self.worker, self.dp_rank, self.stages, self.device)
                            if self.job.checkpoint.dir is not None or self.job.resume is not None else None)
        if self.job.resume is not None:
            self.checkpoints.restore(self.job.resume)  # type: ignore[union-attr]
        self.collector = StepCollector(t.python_gc == "step").start()  # last: freezes what set-up built
        return {"rank": self.rank, "worker": self.worker, "stages": sorted(self.stages.modules),
                "device": str(self.device), "params": sum(p.numel() for p in self.stages.params), "pid": os.getpid(),
                "cpus": self.cpus}

    def _loader(self, segs: list[list[Action]]) -> Callable[[int, StepState], None] | None:
        """What a communication batch does while it waits for its receives: load the data of the forward after it,
        and in the step's last batch that of the next step's first forwards."""
        ahead, nxt = self.compute.data_ahead(segs), self.compute.next_step_ahead(segs)
        if not ahead and nxt is None:
            return None
        load, load_next = self.compute.load_ahead, self.compute.load_next
        last, first = nxt if nxt is not None else (-1, [])

        def while_waiting(k: int, st: StepState) -> None:
            if k in ahead:
                load(ahead[k], st)
            if k == last:
                load_next(first, st)

        return while_waiting

    def _pin(self) -> list[int] | None:
        """``--cpu-affinity auto``: pin this process to its cores among its host's workers (a collective:
        :mod:`chimera.util.cores`); those cores, or None where the host's workers leave cores free."""
        hosts: list[Any] = [None] * self.world_size
        dist.all_gather_object(hosts, host_id())
        mine = [r for r, h in enumerate(hosts) if h == hosts[self.rank]]
        cpus = pin_worker(mine.index(self.rank), len(mine), self.run.threads)
        return sorted(cpus) if cpus is not None else None

    def pending(self) -> dict[str, Any]:
        """Where this worker is: its step and the index (in its action list) of the action it runs or waits on;
        within a communication batch its first receive. Safe to call from another thread while a step runs."""
        k = self.executor.at
        index = None
        if k is not None:
            seg = self.executor.segments[k]
            first = next((i for i, a in enumerate(seg) if a.kind.is_p2p and not a.kind.is_send), 0)
            index = self._seg_starts[k] + first
        return {"rank": self.rank, "worker": self.worker, "step": self.step_now, "index": index}

    def train_step(self, step: int) -> StepResult:
        """Run the whole action list once; returns loss sums (last-stage workers) and optional events."""
        if self.failed_step is not None:  # a step queued behind a failed one: the process group is broken
            raise RuntimeError(f"{self.name}: step {step} not run, step {self.failed_step} failed")
        self.step_now = step
        stall = self.run.debug_stall
        if stall and stall[0] == self.rank:
            time.sleep(stall[1])
        t_start = time.perf_counter()
        repeated = self.post.repeated if self.post is not None else 0
        rec = self.recorder if (self.recorder and self.job.timeline.records(step)) else None
        if self.ledger:
            self.ledger.start_step()
        try:
            st = self._run(step, rec)
        except BaseException:
            self.failed_step = step  # keeps its position for pending()
            raise
        if self.budget is not None and self.ledger and self.ledger.peak["total"] > self.budget:
            held = ", ".join(f"{k} {v}" for k, v in self.ledger.peak.items() if k != "total")
            raise RuntimeError(f"{self.name}: held {self.ledger.peak['total']} bytes on the device in step {step}, "
                               f"more than --memory-per-worker ({self.budget} bytes): {held}; raise the budget or "
                               "offload more (--offload)")
        events = rec.finish() if rec else []
        loss_sum = float(st.loss_sum) if st.loss_sum is not None else 0.0
        loss_count, grad_norm = st.loss_count, st.grad_norm
        verdicts = self.post.taken() if self.post is not None else {}
        repeated = (self.post.repeated - repeated) if self.post is not None else 0
        del st  # its garbage goes in this step's collection
        gc_s = self.collector.after_step()
        elapsed = time.perf_counter() - t_start
        ended = time.monotonic()
        digests = self.stages.digests() if self.run.check_replicas else {}
        held = self.checkpoints.after_step(step) if self.checkpoints else 0.0
        return StepResult(step, self.rank, loss_sum, loss_count, elapsed, grad_norm, events=events, digests=digests,
                          payloads=self.comm.payload_sizes(), memory=dict(self.ledger.peak) if self.ledger else {},
                          swap_bytes=self.stages.host.moved if self.stages.host else 0, checkpoint_s=held, gc_s=gc_s,
                          group_ops=self.comm.group_ops(), lr=self.stages.lr, verdicts=verdicts, repeated=repeated,
                          ended_s=ended)

    def _run(self, step: int, rec: EventRecorder | None) -> StepState:
        """Run the action list for ``step``; post-validated, again where the previous step's rollback repeats it,
        and with the step's own verdict taken where it must end drained (:mod:`chimera.runtime.post_validate`)."""
        while True:
            st = StepState(step, self.device)
            if rec:
                rec.start_step(step)  # a repeated run's events replace the first's
            self.comm.start_step()
            self.stages.start_step()
            self.compute.start_step(st)
            self.executor.run(st, rec, self.ledger)
            if self.post is None or not self.post.settle():  # settle: the previous step rolled back, run again
                break
        if self.post is not None and (self.post.cautious or step == self.run.steps - 1
                                      or self._checkpoint_due(step)):
            self.post.drain()  # nothing of the next step runs before the verdict
        return st

    def save(self, step: int) -> str:
        """Write a checkpoint of the state after ``step`` (the last step run) now, on every rank at once; returns
        its directory (a launcher stopping a run early: ``chimera train`` on SIGTERM)."""
        if self.checkpoints is None or self.job.checkpoint.dir is None:
            raise RuntimeError(f"{self.name}: the job has no checkpoint directory")
        if self.post is not None:  # the state saved is validated (every rank drains: one allreduce)
            self.post.drain()
        return self.checkpoints.save_now(step)

    def drain(self) -> dict[int, tuple[float, str]]:
        """``--post-validate``: take the verdict of the step in flight now, on every rank at once (one allreduce), so
        that nothing of it stays pending; the verdicts taken since the last step's result, by step ({} without
        post-validation). A launcher running one step alone calls it to complete that step's record."""
        if self.post is None:
            return {}
        self.post.drain()
        return self.post.taken()

    def _checkpoint_due(self, step: int) -> bool:
        return self.checkpoints is not None and self.checkpoints.due(step)

    def _optimizer_step(self, a: Action, st: StepState) -> None:
        self.batches.wait_sends()
        st.grad_norm = self.stages.optimizer_step(st.step)

    def _post_validation(self) -> PostValidation:
        if self.post is None:  # pragma: no cover - the compiler lowers these kinds only with --post-validate
            raise RuntimeError(f"{self.name}: a post-validated step in a job without post_validate")
        return self.post

    def _stage_update(self, a: Action, st: StepState) -> None:
        post = self._post_validation()
        if not post.updated_any:  # the first: the tied sums (blocking) run in it
            self.batches.wait_sends()
        post.update((a.pipe, a.stage), st.step)

    def _validate(self, a: Action, st: StepState) -> None:
        self._post_validation().start(st.step)

    def _what(self, a: Action, step: int) -> str:
        return (f"{a.kind.value} {a.text()} ({a.kind.spec.name}; pipe {a.pipe}, stage {a.stage}, micro-batch "
                f"{a.microbatch}) in step {step}")

    def state(self) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
        """CPU copies of every stage replica's parameters, keyed by (pipe, stage)."""
        return self.stages.state()

    def close(self) -> None:
        """Finish a checkpoint write in progress; leave the process group; give Python its collector back."""
        if getattr(self, "checkpoints", None) is not None:
            self.checkpoints.close()
        if getattr(self, "comm", None) is not None:
            self.comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if getattr(self, "collector", None) is not None:
            self.collector.close()


def _swap(method: str) -> Callable[[PipelineWorker], Callable[[Action, StepState], None]]:
    """The factory of a swap kind's handler: the host store's ``method`` for the action's stage replica."""
    def make(worker: PipelineWorker) -> Callable[[Action, StepState], None]:
        host: HostStore | None = worker.stages.host
        if host is None:  # pragma: no cover - the compiler lowers swaps only with an offload policy
            raise RuntimeError(f"{worker.name}: a swap action without --offload")
        move = getattr(host, method)
        return lambda a, st: move((a.pipe, a.stage))

    return make


# the built-in kinds' handlers (chimera.runtime.handlers): each a factory called once per worker at set-up
register_handler(Kind.F, lambda w: w.compute.forward)
register_handler(Kind.B, lambda w: w.compute.backward)
register_handler(Kind.I, lambda w: w.compute.backward_input)
register_handler(Kind.W, lambda w: w.compute.backward_weight)
register_handler(Kind.ALLREDUCE_START, lambda w: lambda a, st: w.stages.buckets[(a.pipe, a.stage)].start())
register_handler(Kind.ALLREDUCE_WAIT,
                 lambda w: lambda a, st: w.stages.buckets[(a.pipe, a.stage)].wait(lambda: w._what(a, st.step)))
register_handler(Kind.OPTIMIZER_STEP, lambda w: w._optimizer_step)
register_handler(Kind.STAGE_UPDATE, lambda w: w._stage_update)
register_handler(Kind.VALIDATE, lambda w: w._validate)
register_handler(Kind.SWAP_IN, _swap("swap_in"))
register_handler(Kind.SWAP_OUT, _swap("swap_out"))
register_handler(Kind.GRAD_OUT, _swap("grads_out"))


def _largest_message(job: Job) -> int:
    """Bytes of the largest tensor a pipe sends between two stages (an activation, or its gradient)."""
    return max((math.prod(t.shape) * t.dtype.itemsize for s in range(1, job.schedule.stages)
                for t in job.stage_inputs(s)), default=0)

"""The Ray driver: start or join Ray (:mod:`ray_launch.cluster`), place one actor per worker, rendezvous, train,
report, clean up.

Usage::

    python scripts/prof_steps_ray.py --model bert-mini --schedule chimera --stages 4 --micro-batches 4
    # or from Python
    from ray_launch.recovery import run
    metrics = run(compile_job(TrainConfig.from_flags(model="bert-tiny", stages=2)), out="profiles/run.jsonl")
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from chimera.checkpoint import remove_partial
from chimera.config import ConfigError
from chimera.job import Job
from chimera.runtime import Verdicts, summarize_step
from chimera.runtime.comm import StallError
from chimera.runtime.hang import hang_report
from chimera.runtime.launch import WorkerError, agreed_verdicts
from ray_launch.actor import WorkerActor
from ray_launch.cluster import RunError, connect, reserve, worker_env
from ray_launch.config import LaunchConfig
from ray_launch.placement import run_pre_commands
from ray_launch.rendezvous import FileRendezvous, on_driver_node

logger = logging.getLogger(__name__)


class WorkerLost(RunError):
    """A worker actor died (process killed, node lost): the run can restart from its last checkpoint."""


class Stalled(RunError):
    """A worker's blocking wait ran past ``--timeout``."""


def _chunks(steps: Iterable[int], size: int) -> Iterator[list[int]]:
    """``steps`` in consecutive lists of ``size`` (the last may be shorter)."""
    chunk: list[int] = []
    for s in steps:
        chunk.append(s)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _bundle(job: Job) -> dict[str, float]:
    return {"CPU": 1.0, "GPU": 1.0} if job.run.device == "cuda" else {"CPU": 1.0}


def _gather(refs: Sequence[Any], what: str, timeout_s: float) -> list[Any]:
    """ray.get with a deadline; a failure is reported with the rank that raised it.

    The common case costs two Ray calls (one wait for all, one get). While some workers are still running,
    finished ones are checked every second so that an early failure is reported at once; when several
    workers failed, a root cause is preferred over the stalls it caused on its peers.
    """
    rank_of = {ref: r for r, ref in enumerate(refs)}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    failed = False
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RunError(f"{what}: worker(s) {sorted(rank_of[r] for r in pending)} gave no answer within "
                           f"{timeout_s:g} s")
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(remaining, 1.0))
        if pending and any(_failure(ref, rank_of[ref], what) for ref in ready):
            # one failed: let the others report for a moment, so the root cause (a lost worker) wins
            ray.wait(pending, num_returns=len(pending), timeout=min(remaining, 3.0))
            failed = True
            break
    if not failed:
        try:
            return ray.get(list(refs))
        except (RayTaskError, RayActorError):
            pass
    errors = [e for ref in refs if (e := _failure(ref, rank_of[ref], what, wait=False)) is not None]
    raise min(errors, key=lambda e: (not isinstance(e, WorkerLost), isinstance(e, Stalled))) from None


def _failure(ref: Any, rank: int, what: str, wait: bool = True) -> RunError | None:
    """The error of a finished ``ref`` (None when it succeeded, or, with ``wait=False``, is still running)."""
    if not wait and not ray.wait([ref], timeout=0)[0]:
        return None
    try:
        ray.get(ref)
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        kind = Stalled if isinstance(cause, StallError) else RunError
        return kind(f"worker {rank} failed in {what}: {type(cause).__name__}: {cause}")
    except ActorUnavailableError as e:  # unreachable, not known dead: RayJob.collect asks whether it is lost
        return RunError(f"worker {rank} did not answer in {what}: {str(e).splitlines()[0]}")
    except RayActorError as e:
        return WorkerLost(f"worker {rank} died in {what}: {e}")
    return None


class RayJob:
    """One training job on Ray; use as a context manager so everything it started is stopped."""

    def __init__(self, job: Job, launch: LaunchConfig | None = None, log: Any = None,
                 out_dir: str | Path | None = None) -> None:
        # every launch error surfaces here, before Ray or any actor (the compiler refused the job's)
        self.job = job
        self.launch = (launch or LaunchConfig()).check()
        if job.timeline.nsys and shutil.which("nsys") is None:
            raise ConfigError("--nsys needs Nsight Systems' `nsys` on PATH, and it is not there; install Nsight "
                              "Systems (https://developer.nvidia.com/nsight-systems) or drop --nsys")
        self.log = log or logger.info
        self.node_of_rank: list[str] = []
        self.connect_timeout_s = self.launch.connect_timeout_s
        self.started_ray = False
        self.pg = None
        self.rendezvous: FileRendezvous | None = None
        self.actors: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.clock_offsets: list[float] = []
        self.clock_uncertainty: list[float] = []
        self.profile_dir = Path(out_dir or "profiles").resolve()  # the timeline's files (--profile, --nsys)

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> RayJob:
        try:
            remove_partial(self.job.checkpoint.dir)  # an interrupted write of an earlier run
            self.started_ray = connect(self.launch, self.job.world_size)
            self._place()
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _place(self) -> None:
        if self.launch.pre_cmd:
            results = run_pre_commands(self.launch.pre_cmd)
            self.log(f"--pre-cmd ran on {len(results)} node(s)")
        bundle = _bundle(self.job)
        self.pg, self.node_of_rank = reserve(self.job.world_size, bundle, self.launch, self.job.schedule.workers,
                                             self.log)
        world = self.job.world_size
        options: dict[str, Any] = {}
        runtime_env: dict[str, Any] = {}
        env = worker_env(self.launch, local=on_driver_node(self.node_of_rank))
        if env:
            runtime_env["env_vars"] = env
            self.log("worker environment: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
        if self.job.timeline.nsys:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            runtime_env["nsight"] = {
                "t": "cuda,cudnn,cublas,nvtx", "stop-on-exit": "true",
                "o": str(self.profile_dir / f"{self.job.name}_worker_%p")}
        if runtime_env:
            options["runtime_env"] = runtime_env
        self.actors = [
            WorkerActor.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                **options,
            ).remote()
            for r in range(world)
        ]

    def _setup(self) -> None:
        timeout, world = self.job.run.timeout_s, self.job.world_size
        if on_driver_node(self.node_of_rank):  # a local run: no TCPStore listening on every interface
            self.rendezvous = FileRendezvous()
            init = self.rendezvous.init_method
        else:
            loopback = self.started_ray or ray.util.get_node_ip_address() in ("127.0.0.1", "localhost")
            # the first call waits for the actor process to start (imports torch): allow for a loaded machine
            host, port = _gather([self.actors[0].rendezvous_address.remote(loopback)], "rendezvous",
                                 self.connect_timeout_s + timeout)[0]
            init = f"tcp://{host}:{port}"
        job = ray.put(self.job)
        refs = [a.setup.remote(job, r, world, init) for r, a in enumerate(self.actors)]
        self.infos = _gather(refs, "setup", timeout + self.connect_timeout_s)
        if self.job.timeline.profile:
            self._measure_clocks()

    def _measure_clocks(self, samples: int = 7) -> None:
        """Offset of every worker's monotonic clock from the driver's, and its uncertainty (half the best RTT).

        Workers on the driver's node share its CLOCK_MONOTONIC: offset 0, uncertainty 0.
        """
        here = ray.get_runtime_context().get_node_id()
        self.clock_offsets, self.clock_uncertainty = [], []
        for actor, info in zip(self.actors, self.infos):
            if info["node_id"] == here:
                self.clock_offsets.append(0.0)
                self.clock_uncertainty.append(0.0)
                continue
            best = (float("inf"), 0.0)
            for _ in range(samples):
                t0 = time.perf_counter()
                tw = ray.get(actor.clock.remote(), timeout=self.job.run.timeout_s)
                t1 = time.perf_counter()
                best = min(best, (t1 - t0, tw - (t0 + t1) / 2))
            self.clock_offsets.append(best[1])
            self.clock_uncertainty.append(best[0] / 2)

    def close(self) -> None:
        """Stop the actors, free the placement group, and shut Ray down if this job started it."""
        for a in self.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
        if self.rendezvous is not None:
            self.rendezvous.close()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False

    # -- training ----------------------------------------------------------------------------------
    def submit(self, step: int | Sequence[int]) -> list[Any]:
        """Queue ``step`` (or several steps, run back to back in one call per worker) on every worker without
        waiting; returns the result references for :meth:`collect`."""
        if isinstance(step, int):
            return [a.step.remote(step) for a in self.actors]
        chunk = list(step)
        return [a.run_steps.remote(chunk) for a in self.actors]

    def collect(self, step: int | Sequence[int], refs: list[Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """Wait for the results of a submitted ``step`` (or steps); return the metrics record (a list of them, in
        step order). A failure where a worker no longer answers and Ray declares its node dead is a
        :class:`WorkerLost` (a lost node)."""
        chunk = [step] if isinstance(step, int) else list(step)
        what = f"step {chunk[0]}" if len(chunk) == 1 else f"steps {chunk[0]}-{chunk[-1]}"
        try:
            results = _gather(refs, what, (self.job.run.timeout_s * 5 + 60) * len(chunk))
        except WorkerLost:
            raise
        except RunError as e:
            lost = self.lost_workers()
            if lost:
                raise WorkerLost(f"{lost} (in {what}: {str(e).splitlines()[0]})") from None
            if isinstance(e, Stalled):
                raise Stalled(f"{e}\n{self.hang_report()}") from None
            raise
        per_step = [results] if isinstance(step, int) else [list(rs) for rs in zip(*results)]
        try:
            records = [summarize_step(self.job, rs) | {"_results": rs} for rs in per_step]
        except WorkerError as e:
            raise RunError(str(e)) from None
        return records[0] if isinstance(step, int) else records

    def lost_workers(self, answer_s: float = 5.0) -> str | None:
        """After a failed step: which workers are lost, or None. A worker is lost when it does not answer a call of
        its control group within ``answer_s`` (a live one answers at once, even inside a blocked step) and then Ray
        reports its actor dead or its node dead, within ``--connect-timeout`` (Ray declares a node dead once it
        misses its health checks: ~15 s by default)."""
        refs = [a.pending.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=answer_s)
        silent = []
        for r, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ActorUnavailableError:
                silent.append(r)
            except RayActorError:
                return f"worker {r} died"
            except Exception:  # no answer in time
                silent.append(r)
        if not silent:
            return None
        nodes = {self.node_of_rank[r] for r in silent}
        deadline = time.monotonic() + self.connect_timeout_s
        while time.monotonic() < deadline:
            dead = nodes - {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if dead:
                ranks = [r for r in silent if self.node_of_rank[r] in dead]
                return f"worker(s) {ranks} lost with their node {', '.join(sorted(n[:12] for n in dead))}"
            time.sleep(0.5)
        return None

    def checkpoint(self, step: int) -> str:
        """Write a checkpoint of the state after ``step`` (the last step run) on every worker now; its directory."""
        refs = [a.checkpoint.remote(step) for a in self.actors]
        return _gather(refs, f"checkpoint after step {step}", self.job.run.timeout_s + 60)[0]

    def hang_report(self, timeout_s: float = 5.0) -> str:
        """Every worker's pending action on the step x worker grid of its data-parallel group, and who waits for
        whom (``chimera.runtime.hang``); asked of the actors while their steps are blocked."""
        refs = [a.pending.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        where: dict[int, Any] = {}
        for r, ref in enumerate(refs):
            try:
                where[r] = ray.get(ref, timeout=0)
            except Exception:  # no answer in time, or dead
                where[r] = None
        sched = self.job.schedule
        D = sched.workers
        grids = [hang_report(sched, {w: where.get(g * D + w) for w in range(D)}, g) for g in range(sched.data_parallel)]
        return "what every worker waits on (>..< on the grid):\n" + "\n".join(grids)

    def step(self, step: int) -> dict[str, Any]:
        """Run one step on every worker; return its metrics record. With ``--post-validate`` the workers take the
        step's verdict at its end (:meth:`drain`), so the record is complete but the step does not overlap the next
        one; :meth:`steps` overlaps them."""
        record = self.collect(step, self.submit(step))
        verdicts = Verdicts(self.job)
        done = verdicts.add(record, record) or verdicts.settle(self.drain())
        if not done:
            raise RunError(f"step {step}: the workers drained without its verdict")
        return done[0]

    def drain(self) -> dict[int, tuple[float, str]]:
        """``--post-validate``: every worker takes the verdict of its step in flight now (none runs after it); the
        verdicts taken, by step ({} without post-validation)."""
        if not self.job.run.post_validate:
            return {}
        refs = [a.drain.remote() for a in self.actors]
        return agreed_verdicts(_gather(refs, "the last step's verdict", self.job.run.timeout_s + 60))

    def steps(self, steps: Iterable[int], ahead: int = 1, stop: Callable[[], bool] | None = None, per_call: int = 1
              ) -> Iterator[dict[str, Any]]:
        """Run ``steps`` in order, keeping ``ahead`` further calls queued on the actors; yield each step's record.

        A worker that finishes a step starts the next one at once instead of waiting for the driver's
        round trip (a few ms of Ray RPC per step, paid on the critical path). ``per_call`` steps run back to
        back in one actor call (one Ray task per ``per_call`` steps: less of Ray's per-task work on the workers'
        cores; their records come when the last of them is done). Records come in step order; the first failure
        is raised before any later step is collected, and the queued steps die with the actors when the job
        closes. Once ``stop()`` is true no call is queued any more: the calls queued already finish and are
        yielded.

            with RayJob(job) as ray_job:
                for rec in ray_job.steps(range(job.run.steps)):
                    print(rec["loss"])
        """
        if ahead < 0 or per_call < 1:
            raise ValueError(f"need ahead >= 0 and per_call >= 1, got ahead={ahead}, per_call={per_call}")
        queued: deque[tuple[int | list[int], list[Any]]] = deque()

        verdicts = Verdicts(self.job)  # --post-validate: a step's record waits for its verdict (the next step's)

        def collect(step: int | list[int], refs: list[Any]) -> list[dict[str, Any]]:
            got = self.collect(step, refs)
            return [done for rec in (got if isinstance(got, list) else [got]) for done in verdicts.add(rec, rec)]

        try:
            for chunk in _chunks(steps, per_call):
                if stop is not None and stop():
                    break
                key: int | list[int] = chunk[0] if per_call == 1 else chunk
                queued.append((key, self.submit(key)))
                if len(queued) > ahead:
                    yield from collect(*queued.popleft())
            while queued:
                yield from collect(*queued.popleft())
            if verdicts.held:  # the last step ran stopped early or short of the run's end: take its verdict now
                yield from verdicts.settle(self.drain())
            yield from verdicts.rest()
        except Exception:
            # the steps queued behind a failed one fail too: read their errors, or Ray logs each as unhandled
            refs = [ref for _, step_refs in queued for ref in step_refs]
            ready = ray.wait(refs, num_returns=len(refs), timeout=1.0)[0] if refs else []
            for ref in ready:
                with contextlib.suppress(Exception):
                    ray.get(ref, timeout=0)
            raise

    def states(self) -> list[dict[tuple[str, int], dict[str, torch.Tensor]]]:
        """Every rank's stage parameters (CPU tensors)."""
        blobs = _gather([a.state.remote() for a in self.actors], "state", self.job.run.timeout_s)
        return [torch.load(io.BytesIO(b)) for b in blobs]

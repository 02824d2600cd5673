"""The torch.distributed.pipelining side of ``bench/vs_torch_pipelining.py``.

Launched as its users launch it: one ``torch.multiprocessing`` process per rank (forkserver with torch
preloaded), ``init_process_group("gloo")``, one ``PipelineStage`` per local stage built from chimera's own
layered model, and torch's schedule classes. Every process applies chimera's CPU allocator setting
(``chimera.util.host_memory.keep_freed_memory``), its garbage collection (``StepCollector``: the heap
frozen after set-up, Python's collector after every step, inside its timed window) and its cores (``--cpu-affinity
auto``: where the ranks fill the machine's cores, each rank pinned to its own, round robin by rank), as chimera's
workers do.
One process group hosts every torch schedule of a workload (each with its own stage modules and optimizer)
and runs steps on command, so repetitions alternate between systems without restarting processes.

Step time (rank 0): ``barrier; step; barrier; step x k; barrier``, a step being ``schedule.step(...); tied-weight
sum; optimizer.step()`` and the collector; the time between the last two barriers over ``k`` is the mean of the
``k`` consecutive steps, from all ranks done with the first step to all ranks done with the last (no barrier
between them: a rank starts its next step as soon as it is done with one). The batches are made before the first
barrier.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import re
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.workloads import Workload, input_keys, unpack_target
from chimera.models import LayerChain, StageModule, build_stage
from chimera.models.chain import as_tuple, call
from chimera.optim import build_optimizer
from chimera.util.cores import pin_worker
from chimera.util.host_memory import StepCollector, keep_freed_memory


@dataclass(frozen=True)
class TorchSchedule:
    """A torch.pp schedule: class name and how many stages each rank holds (placement style)."""

    name: str
    per_rank: int  # 1: stage r on rank r; 2: two stages per rank
    style: str = "loop"  # "loop" (rank r: r, r+D) or "v" (rank r: r, 2D-1-r)

    def stages_of(self, rank: int, d: int) -> list[int]:
        if self.per_rank == 1:
            return [rank]
        return [rank, rank + d] if self.style == "loop" else [rank, 2 * d - 1 - rank]

    def feasible(self, d: int, n: int, num_layers: int) -> str | None:
        """None if torch accepts the shape, else why not."""
        parts = d * self.per_rank
        if parts > num_layers:
            return f"{parts} stages > {num_layers} layers"
        if self.name == "ScheduleDualPipeV" and n < parts:
            return f"DualPipeV needs N >= 2D = {parts}"
        return None


TORCH_SCHEDULES = {
    "gpipe": TorchSchedule("ScheduleGPipe", 1),
    "1f1b": TorchSchedule("Schedule1F1B", 1),
    "interleaved1f1b": TorchSchedule("ScheduleInterleaved1F1B", 2, "loop"),
    "dualpipev": TorchSchedule("ScheduleDualPipeV", 2, "v"),
    "zbvzerobubble": TorchSchedule("ScheduleZBVZeroBubble", 2, "v"),
    "interleavedzerobubble": TorchSchedule("ScheduleInterleavedZeroBubble", 2, "loop"),
    "loopedbfs": TorchSchedule("ScheduleLoopedBFS", 2, "loop"),
}


class StageAdapter(nn.Module):
    """A chimera ``StageModule`` with torch.pp's calling convention: positional tensors in and out.

    The first stage takes the input tensors (``input_keys``) as the chain's keyword inputs; the last stage
    returns the last layer's output (regression output, or MLM + NSP logits) so that torch.pp's ``loss_fn``
    computes exactly the chain's loss.
    """

    def __init__(self, stage: StageModule, model: LayerChain) -> None:
        super().__init__()
        self.stage = stage
        self.keys = input_keys(model)

    def forward(self, *args: torch.Tensor) -> Any:
        x: Any = dict(zip(self.keys, args)) if self.stage.is_first else args
        for layer in self.stage.layers:
            x = call(layer, x)
        if self.stage.is_last:
            return x
        # torch.pp's split backward (DualPipeV) detaches stage outputs in place, which views refuse;
        # the delay block returns a view of its input, so hand torch.pp a copy (2x16 floats)
        return tuple(t.clone() if t._is_view() else t for t in as_tuple(x))


def make_loss_fn(model: LayerChain) -> Any:
    """torch.pp ``loss_fn(output, target)``: the chain's loss on the labels packed by ``pack_target``."""
    return lambda out, target: model.loss(out, unpack_target(model, target))


class _Runner:
    """One torch.pp schedule on one rank: its stages, schedule object, optimizer and tied weights."""

    def __init__(self, w: Workload, ts: TorchSchedule, rank: int) -> None:
        from torch.distributed import pipelining

        d = w.stages
        parts = d * ts.per_rank
        model = w.build(parts)
        layers = w.layers(model, parts)
        self.local = ts.stages_of(rank, d)
        mods = {s: StageAdapter(build_stage(model, layers[s], w.seed), model) for s in self.local}
        stages = [pipelining.PipelineStage(mods[s], s, parts, torch.device("cpu")) for s in self.local]
        cls = getattr(pipelining, ts.name)
        loss_fn = make_loss_fn(model)
        if ts.per_rank == 1:
            self.schedule = cls(stages[0], w.micro_batches, loss_fn=loss_fn)
        else:
            self.schedule = cls(stages, w.micro_batches, loss_fn=loss_fn)
        self.first, self.last = 0 in self.local, parts - 1 in self.local
        params = list({id(p): p for m in mods.values() for p in m.parameters()}.values())
        self.optimizer = build_optimizer(params, w.optimizer, lr=1e-3, weight_decay=0.01)
        # tied weights (BERT: word embedding on the first stage, decoder on the last), summed like chimera does
        self.tied: list[nn.Parameter] = []
        for (li, pi), (lj, pj) in model.tied_parameters():
            for m in mods.values():
                for idx, name in ((li, pi), (lj, pj)):
                    if idx in m.stage.indices:
                        self.tied.append(m.stage.layers[m.stage.indices.index(idx)].get_parameter(name))
        holders = [r for r in range(d) if {0, parts - 1} & set(ts.stages_of(r, d))]
        self.tied_group = dist.new_group(holders) if model.tied_parameters() and len(holders) > 1 else None
        self.tied_member = rank in holders
        self.order = compute_order(self.schedule) if ts.per_rank > 1 else None  # GPipe, 1F1B: chimera generates them

    def step(self, args: tuple[torch.Tensor, ...], target: torch.Tensor) -> None:
        kw: dict[str, Any] = {}
        if self.last:
            kw["target"] = target
            kw["losses"] = []
        self.schedule.step(*(args if self.first else ()), **kw)
        if self.tied:
            total = torch.stack([p.grad for p in self.tied]).sum(0)
            if self.tied_group is not None:
                dist.all_reduce(total, group=self.tied_group)
            for p in self.tied:
                p.grad.copy_(total)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def compute_order(schedule: Any) -> str | None:
    """The compute order torch runs for a multi-stage schedule (its ``pipeline_order``), one CSV row per rank as
    ``chimera.schedule.from_csv`` reads it; DualPipeV's overlapped pair ``(F;B)OVERLAP_F_B`` as its two actions,
    which a CPU runs one after the other; its other actions (gradient reduction, unshard) left out. None for a
    single-stage schedule (GPipe, 1F1B)."""
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        return None
    rows = []
    for rank in sorted(order):
        cells: list[str] = []
        for a in order[rank]:
            if a is not None:
                pair = re.fullmatch(r"\((.*)\)OVERLAP_F_B", str(a))
                cells += [c for c in (pair.group(1).split(";") if pair else [str(a)])
                          if re.fullmatch(r"\d+[FBIW]\d+", c)]  # compute only (no REDUCE_GRAD, UNSHARD, ...)
        rows.append(",".join(cells))
    return "\n".join(rows)


def _worker(w: Workload, names: list[str], rank: int, init: str, cmds: Any, out: Any) -> None:
    try:
        keep_freed_memory()  # the allocator setting chimera's CPU workers use, so both sides allocate alike
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=w.stages,
                                timeout=timedelta(seconds=300))
        pin_worker(rank, w.stages, 1)  # chimera's --cpu-affinity auto: its workers' placement
        # new_group is collective: every rank builds every runner in the same order
        runners = {n: _Runner(w, TORCH_SCHEDULES[n], rank) for n in names}
        collector = StepCollector().start()  # Python's collector between steps, as in chimera's workers
        out.put(("ready", rank, {n: r.order for n, r in runners.items()} if rank == 0 else None))
        batches: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
        while True:
            cmd = cmds.get()
            if cmd is None:
                break
            name, steps = cmd
            batches = {k: batches[k] if k in batches else w.batch(k) for k in steps}
            dist.barrier()
            runners[name].step(*batches[steps[0]])
            collector.after_step()
            dist.barrier()
            t0 = time.perf_counter()
            for k in steps[1:]:
                runners[name].step(*batches[k])
                collector.after_step()
            dist.barrier()
            out.put(("step", rank, (time.perf_counter() - t0) / max(1, len(steps) - 1)))
        out.put(("done", rank, None))
    except BaseException as e:  # report, then exit
        out.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchPPGroup:
    """D worker processes hosting the torch.pp schedules ``names`` of workload ``w``; a context manager."""

    def __init__(self, w: Workload, names: list[str], timeout_s: float = 300.0) -> None:
        self.w, self.names, self.timeout_s = w, names, timeout_s
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed.pipelining", "transformers", "chimera.models"])
        self.out = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(w.stages)]
        init = f"tcp://127.0.0.1:{_free_port()}"
        self.procs = [ctx.Process(target=_worker, args=(w, names, r, init, self.cmds[r], self.out), daemon=True)
                      for r in range(w.stages)]

    def __enter__(self) -> TorchPPGroup:
        for p in self.procs:
            p.start()
        self.orders: dict[str, str | None] = self._collect("ready")[0]  # rank 0: every schedule's compute order
        return self

    def __exit__(self, *exc: object) -> None:
        for q in self.cmds:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _collect(self, kind: str) -> dict[int, Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < len(self.procs):
            try:
                k, rank, payload = self.out.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None and r not in got]
                if dead:
                    raise RuntimeError(f"torch.pp rank {dead[0]} exited with code {self.procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"torch.pp ranks {sorted(set(range(len(self.procs))) - set(got))} "
                                       f"gave no '{kind}' within {self.timeout_s:g} s") from None
                continue
            if k == "error":
                raise RuntimeError(f"torch.pp rank {rank} failed: {payload}")
            if k == kind:
                got[rank] = payload
        return got

    def steps(self, name: str, steps: list[int]) -> float:
        """Run ``steps`` of schedule ``name``: the first, then the rest back to back; return rank 0's mean time per step
        of the rest (between the barriers after the first and after the last)."""
        if len(steps) < 2:
            raise ValueError(f"need one step and at least one timed step, got {steps}")
        for q in self.cmds:
            q.put((name, list(steps)))
        return float(self._collect("step")[0])

"""A worker's stage replicas and everything that lives as long as they do: modules, tied parameters, gradient
buckets, optimizer and learning-rate schedule.

Tied parameters (a chain's ``tied`` pairs, e.g. the embedding on the first stage and the decoder on the last) are
left out of the stage buckets and summed, pair by pair, over every rank that holds either end before clipping (on
one rank alone where a V placement puts the first and the last stage together and nothing else holds them). The global
gradient norm counts each stage once: the first pipe's replica in data-parallel group 0. With the optimizer state
sharded (``Job.shards``) the optimizer steps only this rank's parameters; :mod:`chimera.runtime.zero` brings the
others'.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from chimera.job import Job
from chimera.models import StageModule, build_stage
from chimera.offload.store import HostStore
from chimera.optim import build_optimizer, clip_grad_norm_global, step_without_range, warmup_decay_schedule
from chimera.runtime.comm import Communicator, Op
from chimera.runtime.grad_sync import GradBuckets
from chimera.runtime.zero import ShardedUpdate

StageKey = tuple[str, int]


def tied_ranks(job: Job) -> dict[int, tuple[int, ...]]:
    """For every tied pair whose ends sit on different stages (by its index in the chain's ``tied``), the global
    ranks that hold either end: those sum its gradient (a pair on one stage is one parameter there, summed with
    the stage's own gradients)."""
    sched = job.schedule
    stage_of = {i: s for s, layers in enumerate(job.stage_layers) for i in layers}
    out = {}
    for k, ((a, _), (b, _)) in enumerate(job.chain.tied_parameters()):
        if stage_of[a] != stage_of[b]:
            out[k] = tuple(sorted({r for s in (stage_of[a], stage_of[b]) for r in sched.stage_group(s)}))
    return out


class StageState:
    """The stage replicas of one worker and their optimizer (module docstring)."""

    def __init__(self, job: Job, worker: int, dp_rank: int, device: torch.device, comm: Communicator) -> None:
        run, sched, offload = job.run, job.schedule, job.offload
        self.comm = comm
        self.device = device
        # weights offloaded: built in host memory, never whole on the device (the store releases them there)
        self.modules: dict[StageKey, StageModule] = {
            (pipe, s): build_stage(job.chain, job.stage_layers[s], run.seed,
                                   device=torch.device("cpu") if offload.weights_at(s) else device)
            for pipe, s in sched.stages_of(worker)}
        # offloaded (per stage, by its policy): the host store holds the current weights (the optimizer steps
        # them) and, where gradients are offloaded, their sums; ``home`` maps a device parameter to where that
        # lives (itself for a stage kept on the device)
        offloaded = {k: m for k, m in self.modules.items() if offload.optimizer_at(k[1])}
        self.host = HostStore(offloaded, offload, device) if offloaded else None
        for (_, s), mod in self.modules.items():
            if offload.weights_at(s):
                mod.to(device)  # buffers; the parameters are empty until swapped in
        home = self.host.home if self.host else _same
        self.device_params = _unique(p for mod in self.modules.values() for p in mod.parameters())
        # every pair tied across stages with an end here (a V placement: both ends): its ends and the ranks that
        # hold one, summed pair by pair
        # (ends here, the group of the ranks holding an end, the peer where the sum is an exchange between two)
        self.tied: list[tuple[list[torch.nn.Parameter], Any, int | None]] = []
        pairs = job.chain.tied_parameters()
        for k, ranks in tied_ranks(job).items():
            ends = [home(mod.layers[mod.indices.index(layer_idx)].get_parameter(name))
                    for mod in self.modules.values() for layer_idx, name in pairs[k] if layer_idx in mod.indices]
            if ends:
                self.tied.append((ends, *self._tied_peer(ranks)))
        tied_ids = {id(p) for ends, _, _ in self.tied for p in ends}
        self.buckets: dict[StageKey, GradBuckets] = {}
        for (pipe, s), mod in self.modules.items():
            # offloaded gradients are summed over their host copies, on the stage's host group (gloo)
            on_host = offload.gradients_at(s)
            group = comm.grad_group(s, on_host)
            if group is not None:
                grad_home = home if on_host else _same
                params = [grad_home(p) for p in _unique(mod.parameters()) if id(home(p)) not in tied_ids]
                self.buckets[(pipe, s)] = GradBuckets(params, group, comm, sched.stage_group(s))
        comm.open_sums(self._sum_messages())  # every rank, after its sums exist (a collective)
        self.params = [home(p) for p in self.device_params]
        self.norm_params = [home(p) for p in self._norm_params(job, dp_rank)]
        self.clip = run.clip_grad
        # sharded (ZeRO-1): the optimizer holds only the parameters this rank owns (the compiler refused offload)
        self.sharded = ShardedUpdate(job.shards, self.modules, comm) if job.shards is not None else None
        stepped = self.sharded.owned if self.sharded else self.params
        self.optimizer = build_optimizer(stepped, run.optimizer, lr=run.lr, weight_decay=run.weight_decay,
                                         host=self.host is not None)
        self.step_optimizer = step_without_range(self.optimizer)  # optimizer.step() where a profiler would see it
        self.lr = 0.0  # the learning rate of the last update
        self.lr_schedule = warmup_decay_schedule(self.optimizer, run.warmup_steps, max(run.steps, run.warmup_steps),
                                                 run.lr_schedule)

    def _sum_messages(self) -> dict[tuple[Any, int], int]:
        """(group, peer) -> the largest message of this rank's pairwise sums: the buckets exchanged by a pair of
        replicas and the tied pairs summed between two ranks."""
        out: dict[tuple[Any, int], int] = {}
        for buckets in self.buckets.values():
            for key, nbytes in buckets.messages().items():
                out[key] = max(out.get(key, 0), nbytes)
        for ends, group, peer in self.tied:
            if peer is not None:
                out[(group, peer)] = max(out.get((group, peer), 0), max(p.numel() * p.element_size() for p in ends))
        return out

    def _tied_peer(self, ranks: tuple[int, ...]) -> tuple[Any, int | None]:
        """The group of a tied pair's ranks, and the other rank where the sum is an exchange between two (gloo)."""
        group = self.comm.tied_groups.get(ranks)
        others = [r for r in ranks if r != self.comm.rank]
        exchange = group is not None and len(ranks) == 2 and len(others) == 1 and self.comm.posts_early(group)
        return group, others[0] if exchange else None

    def _norm_params(self, job: Job, dp_rank: int) -> list[torch.nn.Parameter]:
        """The parameters whose squared norm this rank adds to the global norm: one replica of every stage, and a
        tied parameter once, where its first end lives."""
        if dp_rank != 0:
            return []
        ends: list[set[int]] = [set(), set()]
        for pair in job.chain.tied_parameters():
            for end, (layer_idx, name) in zip(ends, pair):
                for mod in self.modules.values():
                    if layer_idx in mod.indices:
                        end.add(id(mod.layers[mod.indices.index(layer_idx)].get_parameter(name)))
        second_only = ends[1] - ends[0]
        first_pipe = job.schedule.pipes[0]  # the other pipe's replica of a stage is counted where it is the first's
        return [p for (pipe, _), mod in self.modules.items() if pipe == first_pipe
                for p in _unique(mod.parameters()) if id(p) not in second_only]

    def start_step(self) -> None:
        """Post what the gradient sums can post before the step's compute (exchange receives on gloo)."""
        if self.host:
            self.host.start_step()
        for buckets in self.buckets.values():
            buckets.prepost()

    def optimizer_step(self, step: int) -> float:
        """Sum tied gradients, clip by the global norm, update (at the rate kept in ``lr``; sharded: the owned
        parameters, then the others from their owners), advance the LR schedule; return the norm."""
        fill_grads(self.params)
        self.sum_tied(step)
        norm = 0.0
        if self.clip > 0:
            norm = clip_grad_norm_global(self.params, self.clip, self.norm_allreduce(step), self.norm_params)
        self.lr = float(self.optimizer.param_groups[0]["lr"])  # the rate of this update (the schedule moves on)
        self.step_optimizer()
        self.end_step(step)
        return norm

    def sum_tied(self, step: int) -> None:
        """Sum the gradients of every tied pair over the ranks that hold either end (blocking, pair by pair; between
        two ranks on gloo an exchange, as a pair of replicas sums its buckets: ``a + b == b + a`` bitwise)."""
        for k, (ends, group, peer) in enumerate(self.tied):  # (offloaded: the sums travel through the device)
            fill_grads(ends)
            total = ends[0].grad.to(self.device)  # summed in place: one pass per other end, no stacked copy
            for p in ends[1:]:
                total.add_(p.grad.to(self.device))
            what = f"tied-weight gradient sum {k} in step {step}"
            if peer is not None:
                theirs = torch.empty_like(total)
                works = self.comm.post([Op(False, theirs, peer, group), Op(True, total, peer, group)])
                for w in works:
                    self.comm.wait(w, what)
                if not self.comm.single_byte:
                    total.add_(theirs)
            elif group is not None:  # None: every end is on this rank, summed above
                total = self.comm.allreduce(total, group, what)
            for p in ends:
                if p.grad is not total:
                    p.grad.copy_(total)

    def norm_allreduce(self, step: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The sum over every rank of a squared gradient norm (one allreduce over all ranks: a global barrier)."""
        def allreduce(sq: torch.Tensor) -> torch.Tensor:
            return self.comm.allreduce(sq.to(self.device), None, f"global gradient norm in step {step}")

        return allreduce

    def end_step(self, step: int) -> None:
        """After the update: advance the LR schedule, drop the gradients (sharded: send the owned parameters)."""
        self.lr_schedule.step()
        # every parameter's, not the optimizer's zero_grad: that reaches only the owned ones when sharded, and wraps
        # itself in a profiler range whose first call in a step costs more than the loop (the step's edge)
        for p in self.params:
            p.grad = None
        if self.sharded:
            self.sharded.broadcast(step)  # after the gradients are gone: its buckets take their place

    def state(self) -> dict[StageKey, dict[str, torch.Tensor]]:
        """CPU copies of every stage replica's parameters, keyed by (pipe, stage)."""
        return {k: {n: self._current(p).detach().cpu().clone() for n, p in mod.named_parameters()}
                for k, mod in self.modules.items()}

    def _current(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        """Where the current value of ``p`` lives: its host copy when offloaded (the device may hold none)."""
        return self.host.home(p) if self.host else p

    def digests(self) -> dict[StageKey, str]:
        """SHA-256 of every stage replica's parameters: equal digests mean bitwise-equal replicas."""
        out = {}
        for key, mod in self.modules.items():
            h = hashlib.sha256()
            for p in mod.parameters():
                h.update(self._current(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            out[key] = h.hexdigest()
        return out


def fill_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """A zero gradient for every parameter of ``params`` that has none (no micro-batch reached it)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def _same(p: torch.nn.Parameter) -> torch.nn.Parameter:
    return p


def _unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out

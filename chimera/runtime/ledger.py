"""Memory accounting: the bytes a worker's runtime holds, by category, at its peak within a step.

With ``--profile-memory`` the executor asks the ledger to look after every action: it sums the unique storages
of the tensors the runtime references (parameters, gradients, optimizer state, what the step stashes for its
backwards including the tensors autograd saved and the data loaded ahead of a forward (the next step's first ones
too), messages waiting or in flight, gradient-sum buffers), each
storage counted once, in the first category that holds it; with post-validated steps also the copies each stage's
update keeps for a rollback (``rollback``). The step's peak and its breakdown go into the
step's result; the memory model (``chimera.plan.memory``) is checked against it.

With ``--offload`` what the host store keeps for the offloaded stages (weights, gradient sums, the optimizer
state, gradient sums in progress over host buffers) is host memory: reported as ``host``, outside the device total that
``--memory-per-worker`` bounds (the worker checks the peak against it after every step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from chimera.microbatch import tensors
from chimera.runtime.step_state import StepState

CATEGORIES = ("params", "optimizer", "grads", "activations", "messages", "sync", "rollback")


class MemoryLedger:
    """Peak bytes held by one worker in one step (module docstring)."""

    def __init__(self, stages: Any, batches: Any, post: Any = None, compute: Any = None) -> None:
        self.stages = stages
        self.batches = batches
        self.post = post  # the worker's PostValidation, if its steps are post-validated
        self.compute = compute  # the worker's StageCompute: the next step's data it loaded ahead
        self.peak: dict[str, int] = {}

    def start_step(self) -> None:
        self.peak = dict.fromkeys(("total", *CATEGORIES, "host"), 0)

    def observe(self, st: StepState) -> None:
        """Account for what is held now; keep the breakdown of the largest total so far."""
        seen: set[int] = set()
        stages, host = self.stages, self.stages.host
        sync = [t for b in stages.buckets.values() for t in b.held()]
        on_host = []
        if host:  # per stage: what its policy keeps on the host (the optimizer state of host copies, host sums)
            on_host = [*host.held(), *_state_tensors(stages.optimizer, host.is_host)]
            on_host += [t for (_, s), b in stages.buckets.items() if host.offload.gradients_at(s) for t in b.held()]
        host_bytes = _bytes(on_host, seen)
        # weights in packs and their gradients on the way out: the most held at once during the action (gone by
        # its end)
        packs, flying = host.transient_peak() if host else (0, 0)
        counts = {
            "params": _bytes(stages.device_params, seen) + packs,
            "optimizer": _bytes(_state_tensors(stages.optimizer), seen),
            "grads": _bytes((p.grad for p in stages.device_params if p.grad is not None), seen) + flying,
            "activations": _bytes(_stash_tensors(st) + self._preloaded(), seen),
            "messages": _bytes([*_tuples(st.inbox.values()), *_tuples(st.outbox.values()), *self.batches.held()],
                               seen),
            "sync": _bytes(sync, seen),
            "rollback": _bytes(self.post.held(), seen) if self.post is not None else 0,
        }
        total = sum(counts.values())
        if total > self.peak.get("total", 0):
            self.peak = {"total": total, **counts, "host": host_bytes}

    def _preloaded(self) -> list[torch.Tensor]:
        """The tensors of the next step's data the worker loaded ahead (``StageCompute.load_next``)."""
        loaded = self.compute.preloaded if self.compute is not None else None
        return tensors(list(loaded.values())) if loaded else []


def _tuples(values: Iterable[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    return [t for ts in values for t in ts]


def _state_tensors(optimizer: torch.optim.Optimizer, of: Callable[[torch.Tensor], bool] | None = None
                   ) -> list[torch.Tensor]:
    """The optimizer's state tensors (``of``: only those of the parameters it accepts)."""
    return [v for p, state in optimizer.state.items() if of is None or of(p) for v in state.values()
            if isinstance(v, torch.Tensor)]


def _stash_tensors(st: StepState) -> list[torch.Tensor]:
    """What the step holds for later actions, under every activation resource of the kinds table, and the data
    loaded ahead of its forward."""
    out = [t for held in st.held.values() for value in held.values() for t in value.tensors()]
    return out + (tensors(list(st.data.values())) if st.data else [])


def _bytes(ts: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in ts:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total

"""ZeRO-1 over each stage's replicas (``--shard-optimizer``): a worker keeps optimizer state only for the
parameters it owns (``Job.shards``, decided by the compiler), steps only those, and the new values travel from each
owner to the rest of the stage's group.

The gradients are still summed over the whole group, tied and clipped as before, so the owner computes exactly
what every replica computed without sharding (AdamW, LAMB and SGD update each parameter from its own gradient and
state). The broadcasts go in flat buckets per (stage, owner, dtype), posted for every stage in ascending stage
order (the same order on every rank, so that no two ranks wait on two groups crosswise) and then waited for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from chimera.job import OptimizerShards
from chimera.runtime.comm import Communicator

BUCKET_BYTES = 25 * 2**20


class ShardedUpdate:
    """Which of a worker's parameters it steps, and the broadcasts of the others' (module docstring)."""

    def __init__(self, shards: OptimizerShards, modules: Mapping[tuple[str, int], Any], comm: Communicator) -> None:
        self.comm = comm
        self.owned: list[torch.nn.Parameter] = []
        self.buckets: list[tuple[int, int, Any, list[torch.nn.Parameter]]] = []  # (stage, owner, group, params)
        for (_, s), mod in sorted(modules.items(), key=lambda kv: kv[0][1]):
            named = mod.named_once()
            if s not in shards.owners:  # held by this rank alone
                self.owned += [p for _, p in named]
                continue
            owner = {name: r for name, _, r in shards.owners[s]}
            missing = [n for n, _ in named if n not in owner]
            if missing:
                raise RuntimeError(f"{comm.name}: stage {s}'s parameters {missing[:3]} have no owner in the job's "
                                   "optimizer shards (the job was compiled for another model)")
            by_owner: dict[tuple[int, torch.dtype], list[torch.nn.Parameter]] = {}
            for name, p in named:
                if owner[name] == comm.rank:
                    self.owned.append(p)
                by_owner.setdefault((owner[name], p.dtype), []).append(p)
            for (src, _), params in sorted(by_owner.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                self.buckets += [(s, src, comm.stage_groups[s], b) for b in _buckets(params)]

    def broadcast(self, step: int) -> None:
        """Send the parameters this rank stepped to its stages' groups and take the others' from their owners."""
        pending = []
        for s, src, group, params in self.buckets:
            flat = (_flatten_dense_tensors([p.detach() for p in params]) if src == self.comm.rank
                    else torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device))
            pending.append((s, src, params, flat, self.comm.broadcast_async(flat, src, group)))
        for s, src, params, flat, work in pending:
            self.comm.wait(work, f"stage {s}'s updated parameters from rank {src} (sharded optimizer) in step {step}")
            if src != self.comm.rank and not self.comm.single_byte:
                with torch.no_grad():
                    for p, new in zip(params, _unflatten_dense_tensors(flat, params)):
                        p.copy_(new)


def _buckets(params: Iterable[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out

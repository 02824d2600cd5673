"""Single-process reference training: the same model, data, optimizer and clipping, no pipeline.

Parity tests compare the pipeline runtime against it; it is also a handy baseline::

    ref = train_sequential(job)      # ref.losses, ref.params, ref.grad_norms
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from chimera.job import Job
from chimera.models import SequentialModel, unit_seed
from chimera.optim import (
    build_optimizer,
    clip_coefficient,
    clip_grad_norm_global,
    local_grad_sq_norm,
    scale_grads,
    warmup_decay_schedule,
)


class Reference(NamedTuple):
    """Per-step mean unit loss, final parameters keyed by (layer index, name) (tied parameters listed under every
    layer that holds them), and the per-step global gradient norm (when clipping, as the runtime reports it)."""

    losses: list[float]
    params: dict[tuple[int, str], torch.Tensor]
    grad_norms: list[float]


def train_sequential(job: Job, then: tuple[int, Job] | None = None) -> Reference:
    """Train the job's steps on all N x W units of each step with gradient accumulation, in one process.

    With ``job.run.post_validate`` a step whose global gradient norm is not finite leaves the weights and the
    optimizer state as they were (the LR schedule still advances), as the post-validated runtime does; without it the
    step goes into the optimizer as it is. The norm is computed (and reported) even without clipping.

    ``then=(k, other)``: from step ``k`` on, the units of each step are ``other``'s (its N, W and data), as when a
    checkpoint of step ``k`` is resumed with another layout.
    """
    t = job.run
    model = SequentialModel(job.chain, t.seed)
    params = list(model.parameters())
    opt = build_optimizer(params, t.optimizer, lr=t.lr, weight_decay=t.weight_decay)
    lr = warmup_decay_schedule(opt, t.warmup_steps, max(t.steps, t.warmup_steps), t.lr_schedule)
    layouts = [(j.units(), j.schedule.microbatches, j.schedule.data_parallel)
               for j in (job, *([then[1]] if then is not None else []))]
    losses, norms = [], []
    for step in range(t.steps):
        data, units, width = layouts[1 if then is not None and step >= then[0] else 0]
        scale = 1.0 / (units * width)
        total = 0.0
        for g in range(width):
            for i in range(units):
                inputs, labels = data.get(step, i, g)
                loss = model(inputs, labels, rng=unit_seed(t.seed, step, i, g))  # the runtime's dropout masks
                (loss * scale).backward()
                total += float(loss.detach())
        losses.append(total / (units * width))
        if t.post_validate:  # the norm always (the non-finite check); a non-finite one skips the update
            norms.append(float(local_grad_sq_norm(params).sqrt()))
            coef = clip_coefficient(norms[-1], t.clip_grad) if t.clip_grad > 0 else None
            if coef is not None:
                scale_grads(params, coef)
            if math.isfinite(norms[-1]):
                opt.step()
        else:
            norms.append(clip_grad_norm_global(params, t.clip_grad) if t.clip_grad > 0 else 0.0)
            opt.step()
        lr.step()
        opt.zero_grad(set_to_none=True)
    stage = model.stage
    out = {}
    for k, layer in enumerate(stage.layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            out[(stage.indices[k], name)] = p.detach().clone()
    return Reference(losses, out, norms)


def stage_params_by_layer(stage_state: dict[str, torch.Tensor], indices: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """Map a stage module's ``layers.{k}.{name}`` parameters to (global layer index, name)."""
    out = {}
    for full, t in stage_state.items():
        _, k, name = full.split(".", 2)
        out[(indices[int(k)], name)] = t
    return out

"""Single-process reference training: the same model, data, optimizer and clipping, no pipeline.

Parity tests compare the pipeline runtime against it; it is also a handy baseline::

    losses, params = train_sequential(cfg)
"""

from __future__ import annotations

import torch

from chimera.data import build_dataset
from chimera.models import SequentialModel
from chimera.optim import build_optimizer, clip_grad_norm_global, warmup_decay_schedule
from chimera.runtime.config import TrainConfig


def train_sequential(cfg: TrainConfig) -> tuple[list[float], dict[tuple[int, str], torch.Tensor]]:
    """Train ``cfg.steps`` steps on all N x W micro-batches of each step with gradient accumulation.

    Returns the per-step mean micro-batch loss and the final parameters keyed by (layer index, name),
    tied parameters listed under every layer that holds them.
    """
    plan = cfg.check()
    sched = plan.schedule
    model = SequentialModel(plan.model, cfg.seed)
    params = list(model.parameters())
    opt = build_optimizer(params, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
    lr = warmup_decay_schedule(opt, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps), cfg.lr_schedule)
    mbs = int(cfg.micro_batch_size * sched.microbatch_scale)
    data = build_dataset(plan.model, mbs, plan.model.seq_len, cfg.seed, corpus=cfg.corpus,
                         microbatches=sched.microbatches, data_parallel=sched.data_parallel)
    units = sched.microbatches
    scale = 1.0 / (units * sched.data_parallel)
    losses = []
    for step in range(cfg.steps):
        total = 0.0
        for g in range(sched.data_parallel):
            for i in range(units):
                inputs, labels = data.get(step, i, g)
                loss = model(inputs, labels)
                (loss * scale).backward()
                total += float(loss.detach())
        losses.append(total / (units * sched.data_parallel))
        if cfg.clip_grad > 0:
            clip_grad_norm_global(params, cfg.clip_grad)
        opt.step()
        lr.step()
        opt.zero_grad(set_to_none=True)
    stage = model.stage
    out = {}
    for k, layer in enumerate(stage.layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            out[(stage.indices[k], name)] = p.detach().clone()
    return losses, out


def stage_params_by_layer(stage_state: dict[str, torch.Tensor], indices: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """Map a stage module's ``layers.{k}.{name}`` parameters to (global layer index, name)."""
    out = {}
    for full, t in stage_state.items():
        _, k, name = full.split(".", 2)
        out[(indices[int(k)], name)] = t
    return out

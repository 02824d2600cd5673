"""A delay model for measuring schedules: per block, the forward sleeps ``fwd_s`` (tf), the input-gradient backward
``bwd_s`` (tb) and the weight-gradient backward ``wgrad_s`` (tw); tb and tw default to tf.

A layer chain ``[embedding, sleeping block x num_blocks, head]`` over ``[B, hidden]`` activations with an MSE
loss and random regression data.

Sleeping instead of computing lets D workers share 2 cores without fighting over them, so measured
bubbles reflect the schedule and the runtime, not CPU contention. On Linux the sleeping thread's timer slack is set
to 1 ns (:func:`precise_sleep`), so that a sleep of tf lasts tf and ~0.02 ms, not ~0.08 ms more. With ``num_blocks = D`` and the uniform
partition every stage holds exactly one sleeping block (the embedding and head are tiny linear layers).

With ``tied``, the embedding's and the head's weights are one parameter (their gradients summed over the workers
of the first and the last stage before the update), as a language model's are.

With ``rows`` set (the micro-batch size), a block's sleeps scale with the rows of its batch, as compute does: half a
micro-batch (Chimera's backward halving) sleeps half as long. Without it every call sleeps the full time.

The weight-gradient sleep sits on the path to the block's weight only, so a full backward (B) sleeps tb + tw, while
a split backward sleeps tb in its input-gradient part (I) and tw in its weight-gradient part (W): autograd runs the
weight's branch only when the weight's gradient is asked for.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from chimera.data.synthetic import SyntheticRegressionDataset
from chimera.models.chain import LayerChain
from chimera.models.transformer import own_generator


@dataclass
class DelayConfig:
    """Shape and timing of the delay model."""

    num_blocks: int = 4
    hidden_size: int = 16
    fwd_s: float = 0.05
    bwd_s: float | None = None  # input-gradient seconds per block (None: fwd_s)
    wgrad_s: float | None = None  # weight-gradient seconds per block (None: fwd_s)
    rows: int | None = None  # the batch rows the seconds are for: r rows sleep r/rows of them (None: any batch the same)
    tied: bool = False  # the embedding's weight and the head's are one parameter (as a language model ties them)


_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_precise = threading.local()


def precise_sleep(seconds: float) -> None:
    """Sleep ``seconds`` (none at all for 0: ``sleep(0)`` still yields the CPU, a cost the model does not mean), on
    Linux with the calling thread's timer slack set to 1 ns first (once per thread): with the default 50 µs a sleep
    overshoots by ~0.08 ms on the development machine, with 1 ns by ~0.02 ms, so the model's compute is what it says."""
    if not seconds:
        return
    if not getattr(_precise, "done", False):
        _precise.done = True
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    time.sleep(seconds)


def timer_slack_ns() -> int | None:
    """The calling thread's timer slack in ns (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    return int(ctypes.CDLL(None).prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0))


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        precise_sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        precise_sleep(ctx.bwd_s)
        return grad, None, None


class _SleepOnGrad(torch.autograd.Function):
    """Identity on a weight whose backward sleeps: the weight-gradient part of a block's backward."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, wgrad_s: float) -> torch.Tensor:
        ctx.wgrad_s = wgrad_s
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        precise_sleep(ctx.wgrad_s)
        return grad, None


class _Embed(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Block(nn.Module):
    def __init__(self, h: int, fwd_s: float, bwd_s: float, wgrad_s: float, rows: int | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(h, h)
        self.fwd_s, self.bwd_s, self.wgrad_s, self.rows = fwd_s, bwd_s, wgrad_s, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[0] / self.rows if self.rows else 1.0  # half a micro-batch (backward halving) sleeps half
        weight = _SleepOnGrad.apply(self.proj.weight, self.wgrad_s * k)
        return _Sleep.apply(nn.functional.linear(x, weight, self.proj.bias), self.fwd_s * k, self.bwd_s * k)


def _mse(out: torch.Tensor, labels: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(out, labels["y"])


def _layer(config: DelayConfig, index: int) -> nn.Module:
    h = config.hidden_size
    if index == 0:
        layer: nn.Module = _Embed(h)
    elif index == config.num_blocks + 1:
        layer = nn.Linear(h, h)
    else:
        tb = config.fwd_s if config.bwd_s is None else config.bwd_s
        tw = config.fwd_s if config.wgrad_s is None else config.wgrad_s
        layer = _Block(h, config.fwd_s, tb, tw, config.rows)  # the same as DelayModel.block_seconds
    gen = own_generator()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1, generator=gen)
    return layer


def _data(hidden: int, micro_batch_size: int, seed: int, microbatches: int, data_parallel: int
          ) -> SyntheticRegressionDataset:
    return SyntheticRegressionDataset(hidden, micro_batch_size, seed)


class DelayModel(LayerChain):
    """Embedding, ``num_blocks`` sleeping blocks, regression head; activations are ``[B, hidden]``."""

    family = "delay"

    def __init__(self, name: str, config: DelayConfig) -> None:
        if config.num_blocks < 1:
            raise ValueError(f"{name} needs at least one block, got num_blocks={config.num_blocks}")
        self.config = config
        layers = [partial(_layer, config, i) for i in range(config.num_blocks + 2)]
        example = SyntheticRegressionDataset(config.hidden_size, 1, 0).get(0, 0, 0)
        tied = [((0, "proj.weight"), (config.num_blocks + 1, "weight"))] if config.tied else []
        super().__init__(layers, _mse, example, tied=tied, name=name, data=partial(_data, config.hidden_size))

    @property
    def block_seconds(self) -> tuple[float, float, float]:
        """Forward, input-gradient and weight-gradient seconds of one block (tf, tb, tw)."""
        c = self.config
        return c.fwd_s, c.fwd_s if c.bwd_s is None else c.bwd_s, c.fwd_s if c.wgrad_s is None else c.wgrad_s

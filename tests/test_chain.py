"""The model contract: a user's chain of layers (no transformer assumed), shapes inferred on the meta device,
declared tied parameters, the public API (chimera.train) and errors raised before any worker starts."""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import chimera
from chimera.api import build_job as chain_job
from chimera.config import ConfigError
from chimera.models import ChainError, LayerChain, TensorSpec, build_stage
from chimera.models import stage as stage_mod
from chimera.runtime import run_local, stage_params_by_layer, train_sequential

ROOT = Path(__file__).resolve().parents[1]


def images(step: int, microbatch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + microbatch * 10 + rank)
    x = torch.randn(4, 3, 8, 8, generator=g)
    return x, (x.mean(dim=(1, 2, 3)) > 0).long()


def cnn() -> LayerChain:
    conv = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())  # noqa: E731
    return LayerChain([conv, lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
                       lambda: nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU()),
                       nn.Linear(16, 2)],  # a module instance: copied into every process
                      loss=nn.functional.cross_entropy, example=images(0, 0, 0), name="cnn")


def tied_lm() -> LayerChain:
    """An embedding and an output projection that are one parameter, on different stages."""
    def tokens(step: int, mb: int, rank: int):
        g = torch.Generator().manual_seed(step * 100 + mb * 10 + rank)
        ids = torch.randint(0, 50, (4, 6), generator=g)
        return ids, ids.roll(1, dims=1)

    def loss(logits, labels):
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    layers = [lambda: nn.Embedding(50, 16), lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
              lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh()), lambda: nn.Linear(16, 50, bias=False)]
    return LayerChain(layers, loss, tokens(0, 0, 0), tied=[((0, "weight"), (3, "weight"))], name="tied-lm",
                      data=lambda mbs, seed, n, w: _Fn(tokens))


class _Fn:
    def __init__(self, fn):
        self.fn = fn

    def get(self, step, mb, rank):
        return self.fn(step, mb, rank)


def _parity(job) -> None:
    res = run_local(job, return_state=True)
    ref = train_sequential(job)
    for m, r in zip(res.metrics, ref.losses):
        assert abs(m["loss"] - r) <= 1e-6
    for state in res.states.values():
        for (_, stage), params in state.items():
            for k, v in stage_params_by_layer(params, job.stage_layers[stage]).items():
                assert (v - ref.params[k]).abs().max().item() <= 1e-5, k


def test_boundaries_of_a_cnn_are_inferred_without_any_layout_assumption():
    specs = cnn().boundaries(5)
    assert specs[1] == [TensorSpec((5, 8, 8, 8), torch.float32, True)]
    assert specs[2] == [TensorSpec((5, 8, 4, 4), torch.float32, True)]
    assert specs[3] == [TensorSpec((5, 16), torch.float32, True)]


@pytest.mark.parametrize("flags", [
    {"schedule": "chimera", "stages": 2, "micro_batches": 4},
    {"schedule": "chimera", "stages": 4, "micro_batches": 8, "mode": "halving"},
    {"schedule": "1f1b", "stages": 2, "micro_batches": 2, "data_parallel": 2},
])
def test_user_cnn_trains_like_sequential(flags):
    _parity(chain_job(cnn(), images, steps=3, optimizer="sgd", lr=0.1, clip_grad=1.0, partition="uniform", **flags))


def test_declared_tied_parameters_stay_one_parameter():
    chain = tied_lm()
    first, last = chain.build_layers([0], seed=3)[0], chain.build_layers([3], seed=3)[0]
    assert torch.equal(first.weight, last.weight)  # the second end starts as a copy of the first
    both = chain.build_layers([0, 3], seed=3)
    assert both[0].weight is both[1].weight
    job = chain_job(chain, None, schedule="chimera", stages=2, micro_batches=2, steps=3, optimizer="adamw",
                    partition="uniform")
    _parity(job)


def test_factories_are_seeded_per_layer_and_modules_copied():
    chain = cnn()
    a, b = chain.build_layers([0, 3], seed=1), chain.build_layers([0, 3], seed=1)
    assert torch.equal(a[0][0].weight, b[0][0].weight)
    assert not torch.equal(a[0][0].weight, chain.build_layers([0], seed=2)[0][0].weight)
    assert a[1] is not chain.layers[3] and torch.equal(a[1].weight, chain.layers[3].weight)


def test_public_api_returns_decreasing_losses():
    same_batches = lambda step, mb, rank: images(0, mb, rank)  # noqa: E731 - the loss on them must fall
    records = chimera.train(cnn(), same_batches, schedule="chimera", stages=2, micro_batches=4, steps=12, lr=1e-2,
                            optimizer="adamw")
    assert [r["step"] for r in records] == list(range(12))
    assert records[-1]["loss"] < records[0]["loss"] - 0.1
    assert records[0]["samples_per_s"] > 0


def _bad(layers, loss=nn.functional.cross_entropy, example=None):
    return LayerChain(layers, loss, example or (torch.randn(4, 6), torch.zeros(4, dtype=torch.long)), name="bad")


@pytest.mark.parametrize("chain,message", [
    (_bad([lambda: nn.Linear(6, 8), lambda: nn.Linear(7, 2)]), r"layer 1 of bad \(Linear\) fails on the example "
                                                               r"micro-batch \(the output of layer 0: tensor \[4, 8\]"),
    (_bad([lambda: nn.Linear(6, 8), lambda: nn.Flatten(0), lambda: nn.Linear(8, 2)]),
     r"layer 1 of bad returns tensors of shape \[\(32,\)\] for a micro-batch of 4 samples; tensors between layers "
     r"need the samples in dim 0"),
    (_bad([lambda: nn.Linear(6, 4), lambda: nn.Linear(4, 2)], loss=lambda out, y: out.sum(1)),
     "must return a floating-point scalar"),
    (_bad([lambda: nn.Linear(6, 8), lambda: 3]), "its factory returned a int, not an nn.Module"),
])
def test_broken_chains_are_refused_before_any_worker(chain, message):
    with pytest.raises(ConfigError, match=message):
        chimera.train(chain, lambda s, m, r: (torch.randn(4, 6), torch.zeros(4, dtype=torch.long)), stages=2,
                      micro_batches=2)


def test_bad_data_and_options_are_refused():
    with pytest.raises(ConfigError, match="samples in dim 0"):
        chimera.train(cnn(), lambda s, m, r: (torch.randn(4, 3, 8, 8), torch.zeros(3, dtype=torch.long)),
                      stages=2, micro_batches=2)
    with pytest.raises(ConfigError, match="has no dataset of its own"):
        chimera.train(cnn(), stages=2, micro_batches=2)
    with pytest.raises(ConfigError, match="unknown training option 'stage'"):
        chimera.train(cnn(), images, stage=2)
    with pytest.raises(ChainError, match="at least one layer"):
        LayerChain([], nn.functional.mse_loss, (torch.zeros(1), torch.zeros(1)))


@torch.library.custom_op("chimera_test::shifted", mutates_args=())
def _shifted(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@_shifted.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _Noise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x)


class _Custom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _shifted(x)


class _Refuses(nn.Module):
    """Refuses to run under a Python dispatch mode, as some higher-order operators do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _get_current_dispatch_mode() is not None:
            raise RuntimeError("no rule for this dispatch mode")
        return x * 2


def noisy_chain() -> LayerChain:
    """Layers that draw (dropout, a random op, a custom op that might, one the probe cannot watch) and layers that
    do not (dropout at 0)."""
    layers = [lambda: nn.Linear(4, 4), lambda: nn.Dropout(0.5), lambda: nn.Dropout(0.0), _Noise, _Custom, _Refuses,
              lambda: nn.Linear(4, 4)]
    return LayerChain(layers, loss=lambda out, y: ((out - y) ** 2).mean(), example=(torch.ones(3, 4), torch.zeros(3, 4)),
                      name="noisy")


def test_only_layers_that_draw_are_seeded(monkeypatch):
    """The meta-device probe finds which layers draw random numbers: dropout above 0, a tagged random op, any
    operation outside torch's own (it might) and a layer the probe cannot watch; a stage seeds only those, and one
    with none touches no generator."""
    chain = noisy_chain()
    assert [chain.draws(i) for i in range(chain.num_layers)] == [False, True, False, True, True, True, False]
    calls = []
    real = stage_mod._seeding
    monkeypatch.setattr(stage_mod, "_seeding", lambda dev: calls.append(dev) or real(dev))
    quiet = build_stage(chain, [2], seed=0)
    x = (torch.randn(3, 4),)
    before = torch.get_rng_state()
    assert torch.equal(quiet(x, rng=5)[0], quiet(x, rng=None)[0]) and not calls
    assert torch.equal(torch.get_rng_state(), before)
    loud = build_stage(chain, [1, 2, 3], seed=0)
    assert loud.seeds == [1, None, 3]
    a, b, c = (loud(x, rng=r)[0] for r in (5, 5, 6))
    assert len(calls) == 3 and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), before)  # the generator outside left as it was

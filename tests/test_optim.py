"""Optimizer selection, warm-up/decay schedules and global gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
from pytorch_optimizer import Lamb

from chimera.optim import (
    build_optimizer,
    clip_grad_norm_global,
    local_grad_sq_norm,
    step_without_range,
    warmup_decay_schedule,
)


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.zeros(4))]


def test_optimizer_selection() -> None:
    lamb = build_optimizer(_params())
    assert isinstance(lamb, Lamb)  # CPU params (and no apex): pytorch_optimizer fallback
    assert lamb.defaults["max_grad_norm"] == 0.0 and lamb.defaults["weight_decay"] == 0.01
    adamw = build_optimizer(_params(), "adamw", lr=0.1)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["fused"] is True  # CPU: torch's fused kernel
    sgd = build_optimizer(_params(), "sgd", lr=0.5, weight_decay=0.0)
    assert isinstance(sgd, torch.optim.SGD)
    groups = [{"params": _params()[:1]}, {"params": _params()[1:], "weight_decay": 0.0}]
    assert len(build_optimizer(groups, "lamb").param_groups) == 2
    with pytest.raises(ValueError, match="lamb, adamw, sgd"):
        build_optimizer(_params(), "adam")


def test_sgd_step_is_exact() -> None:
    (p, _) = params = _params()
    opt = build_optimizer(params, "sgd", lr=0.5, weight_decay=0.0)
    p.grad = torch.full_like(p, 2.0)
    opt.step()
    assert torch.equal(p.detach(), torch.zeros_like(p))


def _factors(kind: str, warmup: int, total: int) -> list[float]:
    opt = build_optimizer(_params(), "sgd", lr=2.0)
    sched = warmup_decay_schedule(opt, warmup, total, kind)
    out = []
    for _ in range(total + 2):
        out.append(opt.param_groups[0]["lr"] / 2.0)
        opt.step()
        sched.step()
    return out


def test_schedule_shapes() -> None:
    lin = _factors("linear", 4, 12)
    assert lin[:5] == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert lin[8] == pytest.approx(0.5) and lin[12] == 0.0 and lin[13] == 0.0
    cos = _factors("cosine", 2, 10)
    assert cos[2] == pytest.approx(1.0) and cos[6] == pytest.approx(0.5) and cos[10] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(cos[2:], cos[3:]))
    const = _factors("constant", 3, 6)
    assert const == pytest.approx([0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1])
    assert _factors("linear", 0, 4)[0] == 1.0
    opt = build_optimizer(_params(), "sgd")
    with pytest.raises(ValueError, match="linear, cosine, constant"):
        warmup_decay_schedule(opt, 1, 2, "step")
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_decay_schedule(opt, 5, 2)


def test_global_clipping_with_fake_allreduce() -> None:
    params = _params()
    params[0].grad = torch.full((3, 2), 2.0)  # |g|^2 = 24
    params[1].grad = torch.full((4,), 1.0)  # |g|^2 = 4
    assert local_grad_sq_norm(params).item() == pytest.approx(28.0)
    seen = []

    def doubled(sq: torch.Tensor) -> torch.Tensor:  # two identical stages
        seen.append(sq.clone())
        return sq * 2

    norm = clip_grad_norm_global(params, max_norm=1.0, allreduce_sq_norm=doubled)
    assert seen[0].dtype == torch.float64 and seen[0].item() == pytest.approx(28.0)
    assert norm == pytest.approx(math.sqrt(56.0))
    scale = 1.0 / (math.sqrt(56.0) + 1e-6)
    assert torch.allclose(params[0].grad, torch.full((3, 2), 2.0 * scale))
    assert torch.allclose(params[1].grad, torch.full((4,), scale))
    # the local norm after clipping is 1/sqrt(2) of the global bound
    assert local_grad_sq_norm(params).item() == pytest.approx(0.5, rel=1e-5)


def test_clipping_no_op_and_edge_cases() -> None:
    params = _params()
    params[0].grad = torch.full((3, 2), 0.1)
    before = params[0].grad.clone()
    norm = clip_grad_norm_global(params, max_norm=10.0, allreduce_sq_norm=None)
    assert norm == pytest.approx(math.sqrt(0.06)) and torch.equal(params[0].grad, before)
    assert clip_grad_norm_global(_params(), 1.0) == 0.0  # no grads at all
    params[0].grad = torch.full((3, 2), float("inf"))
    assert math.isinf(clip_grad_norm_global(params, 1.0))


def _stepped(name: str, step_of) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = build_optimizer(model.parameters(), name, lr=0.01)
    step = step_of(opt)
    for _ in range(3):
        model(torch.randn(4, 6)).square().sum().backward()
        step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb"])
def test_a_step_without_the_profiler_range_updates_as_the_step_does(name: str, monkeypatch) -> None:
    entered: list[str] = []
    enter = torch.autograd.profiler.record_function.__enter__

    def counted(self):  # every optimizer step's profiler range entered in this process
        if self.name.startswith("Optimizer.step#"):
            entered.append(self.name)
        return enter(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", counted)
    plain = _stepped(name, lambda opt: opt.step)
    assert len(entered) == 3  # torch ranges each step: what the call below leaves out
    entered.clear()
    quiet = _stepped(name, step_without_range)
    assert entered == []
    assert all(torch.equal(a, b) for a, b in zip(plain, quiet))  # bit for bit


def test_a_step_without_the_range_keeps_it_where_it_is_seen() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = step_without_range(opt)
    seen: list[str] = []
    handle = opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))  # after the call was made
    model(torch.ones(1, 3)).sum().backward()
    step()
    assert seen == ["post"]  # a hook runs: the step is torch's own, with its range
    handle.remove()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    assert any(e.name.startswith("Optimizer.step#SGD.step") for e in prof.events())  # a profiler sees its range


def test_a_step_without_the_range_is_seen_by_the_lr_schedule_and_yields_to_other_wrappers() -> None:
    import warnings

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = step_without_range(opt)  # made before the schedule wraps the instance's step, as the runtime makes it
    schedule = warmup_decay_schedule(opt, 2, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" where the schedule missed it
        for _ in range(3):
            model(torch.ones(1, 3)).sum().backward()
            step()
            schedule.step()
    calls: list[int] = []
    theirs = opt.step

    def wrapped(*args, **kwargs):  # someone else's wrapper on the instance: the step goes through it
        calls.append(1)
        return theirs(*args, **kwargs)

    opt.step = wrapped
    step()
    assert calls == [1]


def test_a_step_of_an_optimizer_torch_does_not_wrap_is_its_own() -> None:
    class Plain:  # not a torch optimizer: its step's only decorator is torch.no_grad
        def __init__(self, params) -> None:
            self.params = list(params)

        @torch.no_grad()
        def step(self) -> None:
            for p in self.params:
                p.add_(p.grad, alpha=-0.5)  # in place on a leaf: only without grad

    model = torch.nn.Linear(3, 2)
    opt = Plain(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    before = model.bias.detach().clone()
    step_without_range(opt)()  # the bare function under no_grad would raise here
    assert torch.equal(model.bias, before - 0.5)

"""The backward's short paths, each the same gradients bit for bit: the last stage differentiates each unit's loss
from a seed gradient equal to the loss scale (1 / units x W) instead of multiplying the loss by the scale first (one
tensor operation and one autograd node fewer per unit on a backward that sits on the step's critical path), and
every backward calls autograd's engine without torch.autograd.backward's Python checks in front of it."""

import copy
from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chimera.compile import compile_job
from chimera.config import TrainConfig
from chimera.models import build_stage, unit_seed
from chimera.runtime.compute import StageCompute, differentiate
from chimera.runtime.step_state import StepState
from chimera.schedule.kinds import Msg, Res


class _Ops(TorchDispatchMode):
    """The aten operations run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])  # a whole backward, and a split one (I, then W)
def test_the_last_stage_seeds_its_backward_with_the_loss_scale(schedule):
    cfg = TrainConfig.from_flags(model="delay", model_overrides={"num_blocks": 2, "fwd_s": 0.0}, schedule=schedule,
                                 stages=2, micro_batches=3, steps=1, threads=1, corpus="synthetic",
                                 partition="uniform")
    job = compile_job(cfg)
    mods = {(p, s): build_stage(job.chain, job.stage_layers[s], job.run.seed) for p, s in job.schedule.stages_of(1)}
    (_, mod), = mods.items()
    ref = copy.deepcopy(mod)
    compute = StageCompute(job, mods, 1, 0, torch.device("cpu"), nullcontext())
    assert compute.loss_scale == 1 / 3
    acts = [a for a in job.schedule.actions[1] if a.kind.is_compute]
    forwards = [a for a in acts if a.kind.value == "F"][:2]
    backs = [a for a in acts if a.kind.value in ("B", "I")][:2]
    st = StepState(0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    inputs = {}
    for f in forwards:
        x = tuple(torch.randn(s.shape, generator=gen) for s in job.stage_inputs(1))
        inputs[f.microbatch] = x
        st.inbox[Msg(Res.ACT, f.pipe, 0, f.microbatch)] = x
        compute.forward(f, st)
    run = compute.backward if backs[0].kind.value == "B" else compute.backward_input
    run(backs[0], st)
    ops = _Ops()
    with ops:  # the seed is made once per loss form: the second unit's backward makes none and multiplies nothing
        run(backs[1], st)
    assert not [op for op in ops.ops if op.startswith(("aten.mul", "aten.full"))], ops.ops
    for w in [a for a in acts if a.kind.value == "W"][:2]:
        compute.backward_weight(w, st)
    # the reference: each unit's loss times the scale, differentiated from one
    for b in backs:
        data = compute._data(b.pipe, b.microbatch, 0)
        x = tuple(t.detach().requires_grad_(True) for t in inputs[b.microbatch])
        unit = compute.schedule.global_microbatch(b.pipe, b.microbatch)
        loss = ref(x, inputs=data[0], labels=data[1], rng=unit_seed(job.run.seed, 0, unit, 0))
        (loss * (1 / 3)).backward()
        got = st.outbox[Msg(Res.GRAD, b.pipe, b.stage, b.microbatch)]
        assert torch.equal(got[0], x[0].grad)  # the input gradient sent to stage 0
    for p, q in zip(mod.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_differentiate_is_torch_backward_with_the_engine_checks():
    """The engine call gives torch.autograd.backward's gradients (accumulated into ``.grad``, as a second unit's
    are), and the engine still refuses a gradient whose shape is not its output's."""
    gen = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(5, 4)
    x = torch.randn(3, 5, generator=gen)
    grads = [torch.randn(3, 4, generator=gen) for _ in range(2)]
    got, want = copy.deepcopy(layer), copy.deepcopy(layer)
    for g in grads:
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        differentiate([got(xs[0])], [g])
        torch.autograd.backward([want(xs[1])], [g])
        assert torch.equal(xs[0].grad, xs[1].grad)
    for p, q in zip(got.parameters(), want.parameters()):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="shape"):
        differentiate([layer(x)], [torch.ones(3, 5)])

"""The worker runtime (torch.multiprocessing, no Ray) trains exactly what sequential training does."""

import itertools
import time

import pytest
import torch

from chimera.runtime import (
    ConfigError,
    TrainConfig,
    WorkerError,
    run_local,
    stage_params_by_layer,
    train_sequential,
)

BASE = TrainConfig(model="bert-tiny", micro_batch_size=2, seq_len=16, steps=5, optimizer="adamw", lr=1e-3,
                   timeout_s=60, check_replicas=True, corpus="synthetic")


def assert_parity(cfg: TrainConfig) -> None:
    res = run_local(cfg, return_state=True)
    ref_losses, ref = train_sequential(cfg)
    plan = cfg.check()
    assert len(res.metrics) == cfg.steps
    for m, r in zip(res.metrics, ref_losses):
        assert abs(m["loss"] - r) <= 1e-6, (m["step"], m["loss"], r)
    replicas: dict[int, list[dict]] = {}
    for state in res.states.values():
        for (_, stage), params in state.items():
            got = stage_params_by_layer(params, plan.stage_layers[stage])
            replicas.setdefault(stage, []).append(params)
            for k, v in got.items():
                assert (v - ref[k]).abs().max().item() <= 1e-5, (stage, k)
    for copies in replicas.values():  # every replica of a stage is bitwise identical
        for other in copies[1:]:
            assert all(torch.equal(copies[0][n], other[n]) for n in copies[0])
    assert len(res.states) == plan.world_size


CASES = [
    (sched, d, n_factor, model)
    for sched, d, n_factor, model in itertools.product(("chimera", "1f1b", "gpipe"), (2, 4), (1, 2),
                                                       ("bert-tiny", "gpt2-tiny"))
]


@pytest.mark.parametrize("schedule,d,n_factor,model", CASES)
def test_parity_with_sequential(schedule, d, n_factor, model):
    assert_parity(BASE.replace(model=model, schedule=schedule, stages=d, micro_batches=d * n_factor))


@pytest.mark.parametrize("cfg", [
    BASE.replace(schedule="chimera", stages=2, micro_batches=4, data_parallel=2),
    BASE.replace(schedule="1f1b", stages=2, micro_batches=2, data_parallel=2, model="gpt2-tiny"),
    BASE.replace(schedule="interleaved", stages=2, micro_batches=4, chunks=2),
    BASE.replace(schedule="chimera", stages=2, micro_batches=4, optimizer="lamb", recompute=True, clip_grad=0.5),
    BASE.replace(schedule="chimera", stages=4, micro_batches=4, partition="params", warmup_steps=2,
                 lr_schedule="linear", optimizer="sgd", lr=0.1),
], ids=["chimera-W2", "1f1b-W2-gpt2", "interleaved", "chimera-lamb-recompute-clip", "chimera-params-sgd"])
def test_parity_variants(cfg):
    assert_parity(cfg)


def test_stalled_peer_names_worker_and_action():
    cfg = BASE.replace(schedule="1f1b", stages=2, micro_batches=2, steps=1, timeout_s=3, debug_stall=(0, 20.0))
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        run_local(cfg)
    msg = str(e.value)
    assert "worker 1" in msg and "RECV_ACT" in msg and "micro-batch 0" in msg and "stalled" in msg
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("kw,msg", [
    ({"stages": 8, "micro_batches": 8}, "D=8 is larger than the 4 layers of bert-tiny"),
    ({"stages": 3, "micro_batches": 3}, "even number of --stages"),
    ({"stages": 2, "micro_batches": 3}, "multiple of --stages"),
    ({"micro_batch_size": 0}, "--micro-batch-size must be >= 1"),
    ({"model": "bert-huge"}, "unknown model 'bert-huge'"),
    ({"schedule": "zb-v"}, "unknown schedule 'zb-v'"),
    ({"mode": "doubling", "micro_batches": 8}, "direct concatenation"),
    ({"partition": "1,x"}, "--partition"),
])
def test_invalid_configurations_are_refused(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        BASE.replace(**{"stages": 2, "micro_batches": 2, **kw}).check()

"""The worker runtime (torch.multiprocessing, no Ray) trains exactly what sequential training does."""

import itertools
import time

import pytest
import torch

from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.models import SequentialModel
from chimera.runtime import WorkerError, run_local, stage_params_by_layer, train_sequential

#: a hang fails a test here within this many seconds (pytest-timeout), not at CI's limit
pytestmark = pytest.mark.timeout(180)

BASE = TrainConfig.from_flags(model="bert-tiny", micro_batch_size=2, seq_len=16, steps=5, optimizer="adamw", lr=1e-3,
                              timeout_s=60, check_replicas=True, corpus="synthetic", partition="uniform")


def assert_parity(cfg: TrainConfig) -> list[float]:
    """Per-step loss within 1e-6 and every parameter within 1e-5 of sequential training, the global gradient
    norm (when clipping computes it) within 1e-5 relative, every replica of a stage bitwise equal."""
    job = compile_job(cfg)
    res = run_local(job, return_state=True)
    ref = train_sequential(job)
    assert len(res.metrics) == cfg.training.steps
    for m, r in zip(res.metrics, ref.losses):
        assert abs(m["loss"] - r) <= 1e-6, (m["step"], m["loss"], r)
    if cfg.training.clip_grad > 0:
        for m, r in zip(res.metrics, ref.grad_norms):
            assert abs(m["grad_norm"] - r) <= 1e-5 * max(1.0, r), (m["step"], m["grad_norm"], r)
    replicas: dict[int, list[dict]] = {}
    for state in res.states.values():
        for (_, stage), params in state.items():
            got = stage_params_by_layer(params, job.stage_layers[stage])
            replicas.setdefault(stage, []).append(params)
            for k, v in got.items():
                assert (v - ref.params[k]).abs().max().item() <= 1e-5, (stage, k)
    for copies in replicas.values():  # every replica of a stage is bitwise identical
        for other in copies[1:]:
            assert all(torch.equal(copies[0][n], other[n]) for n in copies[0])
    assert len(res.states) == job.world_size
    return [m["loss"] for m in res.metrics]


CASES = [
    (sched, d, n_factor, model)
    for sched, d, n_factor, model in itertools.product(("chimera", "1f1b", "gpipe"), (2, 4), (1, 2),
                                                       ("bert-tiny", "gpt2-tiny"))
]


@pytest.mark.parametrize("schedule,d,n_factor,model", CASES)
def test_parity_with_sequential(schedule, d, n_factor, model):
    assert_parity(BASE.with_flags(model=model, schedule=schedule, stages=d, micro_batches=d * n_factor))


# SGD without clipping: AdamW, LAMB and active clipping would hide a constant gradient-scale error (a wrong loss
# scale, a mean instead of a sum across replicas); plain SGD moves every parameter by lr x gradient.
SGD = {"optimizer": "sgd", "lr": 0.1, "clip_grad": 0.0, "weight_decay": 0.0}
# the same with a clip threshold no norm reaches: the global gradient norm is computed (and compared), nothing scaled
SGD_NORM = {**SGD, "clip_grad": 1e9}


def assert_same_run(ref, got) -> None:  # noqa: ANN001
    """Two runs of one training (e.g. with and without offload): per-step loss within 1e-6, the global gradient norm
    within 1e-5 relative, every parameter within 1e-5."""
    assert len(got.metrics) == len(ref.metrics)
    for m, r in zip(got.metrics, ref.metrics):
        assert abs(m["loss"] - r["loss"]) <= 1e-6, (m["step"], m["loss"], r["loss"])
        assert abs(m["grad_norm"] - r["grad_norm"]) <= 1e-5 * max(1.0, r["grad_norm"]), (m["step"], m["grad_norm"])
    assert max((ref.states[r][k][n] - got.states[r][k][n]).abs().max().item()
               for r in ref.states for k in ref.states[r] for n in ref.states[r][k]) <= 1e-5


VARIANTS = {
    "chimera-W2": BASE.with_flags(schedule="chimera", stages=2, micro_batches=4, data_parallel=2),
    "1f1b-W2-gpt2": BASE.with_flags(schedule="1f1b", stages=2, micro_batches=2, data_parallel=2, model="gpt2-tiny"),
    "gpipe-W2": BASE.with_flags(schedule="gpipe", stages=2, micro_batches=4, data_parallel=2),
    "interleaved": BASE.with_flags(schedule="interleaved", stages=2, micro_batches=4, chunks=2),
    "interleaved-W2-gpt2": BASE.with_flags(schedule="interleaved", stages=2, micro_batches=2, chunks=2, data_parallel=2,
                                           model="gpt2-tiny"),
    # D = 4 with two chunks: eight stages, GPT-2-tiny with six blocks
    "interleaved-D4N8-gpt2-sgd-noclip": BASE.with_flags(schedule="interleaved", stages=4, micro_batches=8, chunks=2,
                                                        model="gpt2-tiny", model_overrides={"n_layer": 6}, steps=3,
                                                        **SGD_NORM),
    "chimera-lamb-recompute-clip": BASE.with_flags(schedule="chimera", stages=2, micro_batches=4, optimizer="lamb",
                                                   recompute=True, clip_grad=0.5),
    "chimera-params-sgd": BASE.with_flags(schedule="chimera", stages=4, micro_batches=4, partition="params",
                                          warmup_steps=2, lr_schedule="linear", optimizer="sgd", lr=0.1),
    "chimera-sgd-noclip": BASE.with_flags(schedule="chimera", stages=4, micro_batches=8, data_parallel=1, **SGD),
    "chimera-W2-sgd-noclip-gpt2": BASE.with_flags(schedule="chimera", stages=2, micro_batches=2, data_parallel=2,
                                                  model="gpt2-tiny", **SGD),
    "1f1b-W2-sgd-noclip": BASE.with_flags(schedule="1f1b", stages=2, micro_batches=4, data_parallel=2, **SGD),
    # every other run moves its messages through shared memory (--p2p auto); this one through gloo's TCP
    "chimera-W2-p2p-gloo": BASE.with_flags(schedule="chimera", stages=2, micro_batches=4, data_parallel=2, p2p="gloo"),
}


@pytest.mark.parametrize("cfg", VARIANTS.values(), ids=VARIANTS.keys())
def test_parity_variants(cfg):
    assert_parity(cfg)


MODES = [("doubling", 2, 2, "bert-tiny", True), ("doubling", 2, 4, "gpt2-tiny", False),
         ("doubling", 4, 2, "gpt2-tiny", True), ("doubling", 4, 4, "bert-tiny", True),
         ("halving", 2, 2, "gpt2-tiny", False), ("halving", 2, 4, "bert-tiny", True),
         ("halving", 4, 2, "bert-tiny", False), ("halving", 4, 4, "gpt2-tiny", False)]


def mode_config(mode: str, d: int, n_factor: int, model: str, recompute: bool) -> TrainConfig:
    """Chimera in ``mode`` at D = ``d``, N = ``d * n_factor``."""
    return BASE.with_flags(schedule="chimera", mode=mode, stages=d, micro_batches=d * n_factor, model=model,
                           recompute=recompute, steps=3)


@pytest.mark.parametrize("mode,d,n_factor,model,recompute", MODES)
def test_chimera_doubling_and_halving_parity(mode, d, n_factor, model, recompute):
    assert_parity(mode_config(mode, d, n_factor, model, recompute))


def test_chimera_modes_are_the_same_training_as_1f1b():
    """Direct concatenation, forward doubling and backward halving reorder the same work: with one seed, every
    step's loss equals 1F1B's (halving trains on the two halves of each micro-batch)."""
    cfg = BASE.with_flags(stages=2, micro_batches=4, steps=3, **SGD)
    one_f_one_b = [m["loss"] for m in run_local(compile_job(cfg.with_flags(schedule="1f1b"))).metrics]
    for mode in ("direct", "doubling", "halving"):
        losses = [m["loss"] for m in run_local(compile_job(cfg.with_flags(schedule="chimera", mode=mode))).metrics]
        assert max(abs(a - b) for a, b in zip(losses, one_f_one_b)) <= 1e-6, mode


DROPOUT = {"hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.2}


@pytest.mark.timeout(120)
def test_recompute_replays_dropout_masks():
    """With dropout, every layer draws its masks from the unit's seed (seed, step, micro-batch, data-parallel rank):
    the pipeline, with or without recomputation (which must draw the forward's masks again), in direct and forward
    doubling mode (two micro-batches per forward slot, each with its own masks), trains as sequential training."""
    cfg = BASE.with_flags(schedule="chimera", stages=2, micro_batches=4, steps=3, model_overrides=DROPOUT, **SGD_NORM)
    for mode, recompute, width in (("direct", False, 1), ("direct", True, 2), ("doubling", True, 1)):
        assert_parity(cfg.with_flags(mode=mode, recompute=recompute, data_parallel=width))
    # the masks are real: at the same weights (one seed; dropout changes no initial weight) the first step's loss
    # differs from the same run's without dropout
    off = cfg.with_flags(model_overrides={k: 0.0 for k in DROPOUT}, steps=1)
    on_job, off_job = compile_job(cfg.with_flags(steps=1)), compile_job(off)
    on_w, off_w = (dict(SequentialModel(j.chain, j.run.seed).named_parameters()) for j in (on_job, off_job))
    assert all(torch.equal(on_w[n], off_w[n]) for n in on_w)
    with_masks, without = (run_local(j).metrics[0]["loss"] for j in (on_job, off_job))
    assert abs(with_masks - without) > 1e-3, (with_masks, without)


def test_stalled_peer_names_worker_and_action():
    cfg = BASE.with_flags(schedule="1f1b", stages=2, micro_batches=2, steps=1, timeout_s=3, debug_stall=(0, 20.0))
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        run_local(compile_job(cfg))
    msg = str(e.value)
    assert "worker 1" in msg and "RECV_F" in msg and "micro-batch 0" in msg and "stalled" in msg
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("kw,msg", [
    ({"stages": 8, "micro_batches": 8}, "D=8 is larger than the 4 layers of bert-tiny"),
    ({"stages": 3, "micro_batches": 3}, "even number of --stages"),
    ({"stages": 2, "micro_batches": 3}, "multiple of --stages"),
    ({"micro_batch_size": 0}, "--micro-batch-size must be >= 1"),
    ({"model": "bert-huge"}, "--model must be one of bert-48, .* got 'bert-huge'"),
    ({"schedule": "zb-x"}, "--schedule must be one of gpipe, 1f1b, .* got 'zb-x'"),
    ({"mode": "doubling", "micro_batches": 2}, "multiple of 2\\*D=4"),
    ({"mode": "halving", "micro_batches": 4, "micro_batch_size": 3}, "must be even"),
    ({"mode": "tripling"}, "--mode must be one of direct, doubling, halving"),
    ({"partition": "1,x"}, "--partition"),
    ({"lr": -1.0}, "--lr must be > 0, got -1.0$"),
    ({"warmup_steps": -3}, "--warmup-steps must be >= 0"),
    ({"python_gc": "never"}, "--python-gc must be one of step, auto, got 'never'"),
])
def test_invalid_configurations_are_refused(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        compile_job(BASE.with_flags(**{"stages": 2, "micro_batches": 2, **kw}))

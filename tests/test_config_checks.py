"""Every bad input is refused by the command line's parser or the compiler, naming the flag, before any process
starts; a fuzz test over the flags and config fields holds the check to it."""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import chimera
from chimera.cli.options import Parser, UsageError, config_from_args
from chimera.compile import compile_job
from chimera.config import FIELDS as CONFIG_FIELDS
from chimera.config import ConfigError, TrainConfig
from chimera.optim import build_optimizer, warmup_decay_schedule
from ray_launch.command import add_train_args
from ray_launch.config import LaunchConfig

#: a hang fails a test here within this many seconds (pytest-timeout), not at CI's limit
pytestmark = pytest.mark.timeout(300)

TINY = dict(model="bert-tiny", corpus="synthetic", seq_len=16, partition="uniform", stages=2, micro_batches=2)


def _data(step, mb, rank):
    g = torch.Generator().manual_seed(step * 100 + mb * 10 + rank)
    x = torch.randn(4, 6, generator=g)
    return x, x.sum(1, keepdim=True)


CHAIN = chimera.LayerChain([lambda: nn.Linear(6, 8), nn.Tanh, lambda: nn.Linear(8, 8), lambda: nn.Linear(8, 1)],
                           nn.functional.mse_loss, _data(0, 0, 0), name="mlp")


@pytest.mark.parametrize("flags, flag", [({"lr": -1.0}, "--lr"), ({"warmup_steps": -3}, "--warmup-steps"),
                                         ({"lr": float("inf")}, "--lr"), ({"timeout_s": float("nan")}, "--timeout")])
def test_bad_numbers_refused_once_in_the_check(flags, flag):
    with pytest.raises(ConfigError) as e:
        compile_job(TrainConfig.from_flags(**TINY, **flags))
    msg = str(e.value)
    assert msg.startswith(flag) and msg.count("must be") == 1, msg


def test_forward_doubling_with_too_few_micro_batches_names_the_flags():
    """The example the fuzz test below found: the error named neither --mode nor --micro-batches."""
    with pytest.raises(ConfigError, match=r"--mode doubling needs --micro-batches .*use --micro-batches 8 or --mode direct"):
        compile_job(TrainConfig.from_flags(schedule="chimera", mode="doubling", stages=4, micro_batches=4, partition="uniform"), CHAIN, _data)


def test_micro_batch_that_cannot_fit_is_refused_with_the_estimate():
    with pytest.raises(ConfigError) as e:
        compile_job(TrainConfig.from_flags(**TINY, micro_batch_size=100000))
    msg = str(e.value)
    assert msg.startswith("--micro-batch-size 100000 cannot fit") and "GiB at worker" in msg
    assert "activations" in msg and "available on this machine" in msg
    assert "change: --recompute, a smaller --micro-batch-size, more --stages" in msg, msg
    # the same estimate against an explicit budget; a small micro-batch fits
    with pytest.raises(ConfigError, match="--memory-per-worker 1MiB"):
        compile_job(TrainConfig.from_flags(**TINY, memory_per_worker="1MiB"))


def test_out_directory_and_unwritable_paths_refused_before_ray(tmp_path, capsys):
    from ray_launch.cli import main

    code = main(["train", "--model", "bert-tiny", "--corpus", "synthetic", "--seq-len", "16", "--partition", "uniform",
                 "-D", "2", "-N", "2", "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and f"--output {tmp_path} is a directory" in err and "Traceback" not in err
    assert "Ray" not in err
    # a directory no one may write in, root included (CI runs as root): /proc takes no new files
    with pytest.raises(ConfigError, match="--checkpoint-dir .* cannot write under /proc"):
        compile_job(TrainConfig.from_flags(**TINY, checkpoint_dir="/proc/chimera-ck"))
    # a path under a regular file: no one can make a directory there, root included
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"--checkpoint-dir .*/f/ck: .*/f is a file, so nothing can be made under it"):
        compile_job(TrainConfig.from_flags(**TINY, checkpoint_dir=str(tmp_path / "f" / "ck")))
    with pytest.raises(ConfigError, match="--checkpoint-dir .* is a file"):
        compile_job(TrainConfig.from_flags(**TINY, checkpoint_dir=str(tmp_path / "f")))
    with pytest.raises(ConfigError, match="--checkpoint-every needs --checkpoint-dir"):
        compile_job(TrainConfig.from_flags(**TINY, checkpoint_every=2))


def _flag(name: str) -> str:
    return CONFIG_FIELDS[name].flag


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e-3, 1.0]))
FIELDS = {
    "schedule": st.sampled_from(["chimera", "1f1b", "gpipe", "interleaved", "nope"]),
    "stages": st.integers(-1, 6), "micro_batches": st.integers(-1, 9), "micro_batch_size": st.integers(-1, 6),
    "data_parallel": st.integers(-1, 2), "chunks": st.integers(-1, 3),
    "mode": st.sampled_from(["direct", "doubling", "halving", "sideways"]),
    "steps": st.integers(-1, 4), "seed": st.integers(-3, 2**40), "device": st.sampled_from(["cpu", "tpu"]),
    "optimizer": st.sampled_from(["lamb", "adamw", "sgd", "adam"]), "lr": _floats, "weight_decay": _floats,
    "warmup_steps": st.integers(-4, 6), "lr_schedule": st.sampled_from(["linear", "cosine", "constant", "step"]),
    "clip_grad": _floats, "timeout_s": _floats, "threads": st.one_of(st.none(), st.integers(-1, 3)),
    "memory_per_worker": st.sampled_from([None, "1GiB", "-3GB", "lots", "1e3", "64KiB"]),
    "profile_steps": st.lists(st.integers(-2, 6), max_size=3).map(lambda x: tuple(sorted(set(x)))),
    "comm_payload": st.sampled_from(["full", "single-byte", "half"]),
    "partition": st.sampled_from(["uniform", "params", "2,1,1", "1,1", "x,y", "0,4", "5,0"]),
    "checkpoint_every": st.integers(-2, 3),
    "checkpoint_dir": st.sampled_from([None, "__tmp__", "/proc/version/ck"]),
}


def _refusal(flags: dict) -> str | None:
    """The compiler's refusal of ``flags``, or None when it accepts them."""
    try:
        compile_job(TrainConfig.from_flags(**flags), CHAIN, _data)
    except ConfigError as e:
        return str(e)
    return None


WRONG_TYPE = st.sampled_from(["3", 2.5, [1], True, None])  # what a caller or an argparse quirk may pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({}, optional={k: st.one_of(v, WRONG_TYPE) if k in ("steps", "lr", "stages", "threads",
                                                                                 "seed", "checkpoint_every", "mode")
                                           else v for k, v in FIELDS.items()}))
def test_fuzz_every_rejection_is_in_the_check_and_names_the_field(tmp_path, flags):
    if flags.get("checkpoint_dir") == "__tmp__":
        flags["checkpoint_dir"] = str(tmp_path / "ck")
    try:
        job = compile_job(TrainConfig.from_flags(**flags), CHAIN, _data)
    except ConfigError as e:
        # the refusal names a field of this example that it depends on: without that field (its default) this
        # refusal is not given (another may be, or none)
        named = {k for k in flags if _flag(k) in str(e)}
        culprits = {k for k in flags if _refusal({f: v for f, v in flags.items() if f != k}) != str(e)}
        assert named & culprits, f"{e!r} names {sorted(named)}; it is given because of {sorted(culprits)}"
        return
    # accepted: what the workers build from these fields must accept them too
    t = job.run
    assert math.isfinite(t.lr) and math.isfinite(t.timeout_s)
    p = nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], t.optimizer, lr=t.lr, weight_decay=t.weight_decay)
    warmup_decay_schedule(opt, t.warmup_steps, max(t.steps, t.warmup_steps), t.lr_schedule)


TEXT_FLAGS = ["--stages", "--micro-batches", "--micro-batch-size", "--lr", "--steps", "--timeout", "--threads",
              "--warmup-steps", "--clip-grad", "--checkpoint-every", "--max-restarts", "--profile-steps", "--device",
              "--optimizer", "--mode", "--lr-schedule", "--comm-payload"]
#: flags whose refusal may rightly name another flag it depends on (--stages with the default --micro-batches)
DEPENDS = {"--stages": ("--micro-batches",), "--micro-batches": ("--stages",), "--steps": ("--profile-steps",)}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(TEXT_FLAGS), st.text(alphabet="0123456789-.eaxn,", min_size=1, max_size=6))
def test_fuzz_flag_text_refused_by_argparse_naming_the_flag(flag, text):
    p = Parser(prog="chimera train")
    add_train_args(p)
    try:
        ns = p.parse_args([flag, text] if not text.startswith("-") else [f"{flag}={text}"])
    except UsageError as e:
        assert flag in str(e), str(e)
        return
    cfg, _ = config_from_args(ns)
    cfg = cfg.with_flags(partition="uniform")  # the flag's checks, not a planning profile per example
    launcher = {f.name for f in dataclasses.fields(LaunchConfig)} | {"config", "run_dir", "output", "no_progress",
                                                                      "dry_run", "log_level"}
    assert set(vars(ns)) <= set(CONFIG_FIELDS) | launcher
    try:
        compile_job(cfg, CHAIN, _data)
    except ConfigError as e:
        assert any(f in str(e) for f in (flag, *DEPENDS.get(flag, ()))), str(e)

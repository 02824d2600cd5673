"""What every metrics record carries (the learning rate of its update, tokens/s), TensorBoard output when asked, and
logging instead of prints in library code."""

import ast
import logging
import sys
from pathlib import Path

import pytest

import chimera
from chimera.cli import configure_logging
from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.runtime import run_local

ROOT = Path(__file__).resolve().parent.parent


def _factor(t: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then linear decay to 0 at ``total`` (written out, not imported)."""
    return t / warmup if t < warmup else 1.0 - (t - warmup) / (total - warmup)


def test_records_carry_the_scheduled_lr_and_tokens_per_s():
    cfg = TrainConfig.from_flags(model="gpt2-tiny", corpus="synthetic", seq_len=16, stages=2, micro_batches=2,
                                 micro_batch_size=1, partition="uniform", steps=5, lr=2e-3, warmup_steps=3,
                                 lr_schedule="linear", optimizer="adamw")
    records = run_local(compile_job(cfg)).metrics
    assert [r["lr"] for r in records] == pytest.approx([2e-3 * _factor(t, 3, 5) for t in range(5)], rel=1e-12)
    assert records[0]["lr"] == 0 and records[3]["lr"] == pytest.approx(2e-3)
    for r in records:  # 16 token positions per sample
        assert r["tokens_per_s"] == pytest.approx(16 * r["samples_per_s"], rel=1e-12)


def test_tokens_per_sample_counts_token_ids_only():
    assert chimera.models.presets.build_model("gpt2-tiny", seq_len=24).tokens_per_sample() == 24
    assert chimera.models.presets.build_model("bert-tiny", seq_len=12).tokens_per_sample() == 12
    assert chimera.models.presets.build_model("delay").tokens_per_sample() is None  # float inputs: no tokens
    cfg = TrainConfig.from_flags(model="delay", model_overrides={"fwd_s": 0.0}, stages=2, micro_batches=2,
                                 partition="uniform", steps=1)
    [rec] = run_local(compile_job(cfg)).metrics
    assert rec["tokens_per_s"] is None and rec["samples_per_s"] > 0


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _check_board(logdir: Path, records: list[dict]) -> None:
    got = _scalars(logdir)
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/step_time_s", "train/grad_norm"} <= set(got)
    for name in ("loss", "lr", "samples_per_s"):  # TensorBoard keeps float32
        assert [s for s, _ in got[f"train/{name}"]] == [r["step"] for r in records]
        assert [v for _, v in got[f"train/{name}"]] == pytest.approx([r[name] for r in records], rel=1e-6)
    assert "train/tokens_per_s" not in got  # the delay model has no tokens: None is not written


DELAY = dict(model="delay", model_overrides={"fwd_s": 0.0}, stages=2, micro_batches=2, partition="uniform",
             steps=3, warmup_steps=2)


def test_tensorboard_from_python_is_written_and_readable(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)  # chimera.train writes under runs/NAME-TIME/
    run = chimera.train(tensorboard=True, return_model=False, **DELAY)
    assert run.tensorboard_dir.is_dir() and run.tensorboard_dir.is_relative_to("runs")
    _check_board(run.tensorboard_dir, run.records)


@pytest.mark.ray
def test_tensorboard_from_the_ray_driver_beside_the_metrics(ray_session, tmp_path):
    pytest.importorskip("tensorboard")
    from ray_launch.recovery import run

    records = run(compile_job(TrainConfig.from_flags(tensorboard=True, **DELAY)), out=tmp_path / "metrics.jsonl",
                  progress=False)
    _check_board(tmp_path / "tensorboard", records)


def test_tensorboard_asked_but_not_installed_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now fails
    with pytest.raises(ConfigError, match=r"--tensorboard needs the tensorboard package.*chimera\[tensorboard\]"):
        compile_job(TrainConfig.from_flags(tensorboard=True, **DELAY))
    compile_job(TrainConfig.from_flags(**DELAY))  # not asked: not needed


def test_log_level_chooses_what_the_library_logs(capsys):
    try:
        configure_logging("warning")
        logging.getLogger("ray_launch.recovery").info("an info line")
        logging.getLogger("chimera.train").warning("a warning line")
        err = capsys.readouterr().err
        assert "an info line" not in err and "WARNING: a warning line" in err
        configure_logging("info")
        logging.getLogger("ray_launch.driver").info("worker -> node")
        assert capsys.readouterr().err == "worker -> node\n"
    finally:
        configure_logging("info")


# where printing is the point: the command line's own output
CLI = {"chimera/cli", "ray_launch/command.py", "ray_launch/cli.py"}


def test_library_code_logs_instead_of_printing():
    printing = []
    for path in sorted((ROOT / "chimera").rglob("*.py")) + sorted((ROOT / "ray_launch").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel == c or rel.startswith(c + "/") for c in CLI):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == "print":  # called, or handed on as a log function
                printing.append(f"{rel}:{node.lineno}")
    assert printing == []

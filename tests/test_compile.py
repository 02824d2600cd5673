"""Compile, then run: the command line and the Python API build the identical Job from the same fields; a config
file gives the same sections (flags override it, a wrong key or type is refused naming it); the help shows the
sections and their defaults; no flag may be abbreviated; renamed flags keep their old spelling for a release; a
run's resolved configuration builds the same job again."""

import json

import pytest

import chimera
from chimera.cli.options import Parser, UsageError, config_from_args
from chimera.compile import compile_job, resolved_config
from chimera.config import FIELDS, ConfigError, TrainConfig, dump, parse
from ray_launch.cli import main as console
from ray_launch.command import add_train_args
from ray_launch.config import LaunchConfig

SAME = dict(model="bert-tiny", corpus="synthetic", seq_len=16, schedule="chimera", stages=2, micro_batches=4,
            micro_batch_size=2, steps=2, optimizer="adamw", lr=2e-4, partition="uniform", split_backward=True,
            offload="optimizer", profile_steps=(1,), clip_grad=0.5)


def argv_of(fields: dict) -> list[str]:
    """The command line that sets ``fields``, from the fields' own flags."""
    out: list[str] = []
    for name, value in fields.items():
        flag = FIELDS[name].flag
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            out += [flag, ",".join(map(str, value))]
        else:
            out += [flag, str(value)]
    return out


def parsed(argv: list[str]) -> tuple[TrainConfig, dict]:
    p = Parser(prog="chimera train")
    add_train_args(p)
    return config_from_args(p.parse_args(argv), {"launch": LaunchConfig})


def test_python_and_the_command_line_build_the_identical_job():
    from_python = chimera.build_job(**SAME)
    cfg, _ = parsed(argv_of(SAME))
    from_cli = compile_job(cfg)
    assert from_cli.describe() == from_python.describe()
    assert json.dumps(from_cli.describe(), default=str)  # plain data
    assert compile_job(cfg.with_flags(lr=1e-3)).describe() != from_python.describe()  # the comparison can fail
    assert from_cli.offload.text == "optimizer" and from_cli.run.clip_grad == 0.5 and from_cli.layout.split_backward


def test_the_defaults_are_one_set():
    """Every field's default is the same from Python, from the command line and from an empty config file."""
    cfg, _ = parsed([])
    assert cfg == TrainConfig() == parse("")[0]
    assert TrainConfig().schedule.partition == "planned"  # once uniform from Python and planned on the command line


def test_config_file_flags_override_and_refusals_name_the_key(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "bert-tiny"\ncorpus = "synthetic"\nseq_len = 16\n\n[schedule]\nstages = 2\n'
                    'micro_batches = 4\npartition = "uniform"\n\n[training]\nsteps = 3\n\n[launch]\nmax_restarts = 2\n')
    cfg, parts = parsed(["--config", str(path), "--steps", "5", "-N", "8"])
    assert (cfg.model.name, cfg.schedule.stages, cfg.schedule.micro_batches, cfg.training.steps) == \
           ("bert-tiny", 2, 8, 5)
    assert {"model", "stages", "micro_batches", "steps"} <= cfg.given and "lr" not in cfg.given
    assert parts["launch"].max_restarts == 2
    for text, message in [("[schedule]\nstagez = 2\n", "unknown key 'stagez' in [schedule]"),
                          ('[training]\nsteps = "3"\n', "[training] steps must be of type int, got '3'"),
                          ("[scheduling]\nstages = 2\n", "unknown section [scheduling]"),
                          ("[schedule\nstages = 2\n", "is not valid TOML")]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        code = console(["train", "--config", str(bad)])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err and "Ray" not in err, err


def test_help_shows_sections_and_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        console(["train", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: chimera train")
    for section in ("[model]", "[schedule]", "[training]", "[memory]", "[profiling]", "[checkpoint]", "[launch]"):
        assert section in out
    assert "pipeline depth D (workers per pipeline) (default: 4)" in out
    assert "(default: 120.0 seconds)" in out and "one of lamb, adamw, sgd" in out


@pytest.mark.parametrize("argv", [["--addr", "auto"], ["--mod", "bert-tiny"], ["--micro", "4"]])
def test_an_abbreviated_flag_is_refused(argv, capsys):
    assert console(["train", *argv]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(UsageError):
        parsed(argv)


def test_renamed_flags_keep_their_old_spelling_for_a_release(tmp_path, capsys):
    code = console(["train", *argv_of(SAME), "--out", str(tmp_path / "m.jsonl"), "--dry-run"])
    captured = capsys.readouterr()
    assert code == 0 and "warning: --out is deprecated: use --output" in captured.err
    assert '[schedule]\nname = "chimera"' in captured.out  # the resolved configuration
    assert console(["schedule", "simulate", "1f1b", "-D", "2", "-N", "2", "--lowered", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["makespan"]
    assert console(["schedule", "simulate", "1f1b", "-D", "2", "-N", "2", "--optimizer", "3", "--lowered", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["makespan"] == plain + 3 and "use --optimizer-time" in captured.err


def test_a_resolved_configuration_builds_the_same_job():
    """What --schedule auto chose, the split and the offload are written into the run's config.toml; --config of it
    compiles to the same job."""
    cfg = TrainConfig.from_flags(model="delay", model_overrides={"num_blocks": 8, "fwd_s": 0.001}, schedule="auto",
                                 stages=4, micro_batches=8, micro_batch_size=2, partition="uniform", steps=2)
    job = compile_job(cfg)
    assert job.decisions and job.decisions[0].startswith("auto: ")
    again_cfg, _ = parse(dump(resolved_config(cfg, job)))
    again = compile_job(again_cfg)
    assert again.layout == job.layout and again.stage_layers == job.stage_layers
    assert {k: v for k, v in again.describe().items() if k != "decisions"} == \
           {k: v for k, v in job.describe().items() if k != "decisions"}


def test_every_field_is_declared_with_help_and_its_flag_is_unique():
    flags = [f.flag for f in FIELDS.values() if f.meta.cli]
    assert len(flags) == len(set(flags))
    assert all(f.meta.help for f in FIELDS.values())
    with pytest.raises(ConfigError, match="unknown training option 'stage'"):
        chimera.build_job(stage=2)


def test_measured_auto_keeps_plain_chimera_unless_clearly_faster():
    """Predictions on a shared CPU miss by up to TRUSTED_GAIN; a smaller predicted gain keeps plain Chimera."""
    from chimera.compile.schedule import TRUSTED_GAIN, _trusted_best
    from chimera.plan.search import Candidate, Evaluated

    def ev(mode: str, step: float) -> Evaluated:
        return Evaluated(Candidate("chimera", mode, 4, 1, 4, 4, False), step_s=step)

    plain = ev("direct", 1.0)
    close, far = ev("halving", 1.0 / (TRUSTED_GAIN - 0.01)), ev("halving", 1.0 / (TRUSTED_GAIN + 0.01))
    assert _trusted_best([close, plain]) is plain
    assert _trusted_best([far, plain]) is far
    assert _trusted_best([plain, close]) is plain


@pytest.mark.timeout(300)
def test_plan_auto_keeps_d_and_n_and_trains():
    """``--plan auto -D 4 -N 8`` plans what was left open (schedule, B, the split...) with the model's profile and
    keeps D = 4 and N = 8, says so, and the job trains (two steps, on the local runtime)."""
    from chimera.runtime import run_local

    cfg = TrainConfig.from_flags(model="bert-tiny", seq_len=16, corpus="synthetic", plan="auto", stages=4,
                                 micro_batches=8, steps=2, threads=1)
    job = compile_job(cfg)
    assert (job.layout.stages, job.layout.micro_batches) == (4, 8)
    (why,) = [d for d in job.decisions if d.startswith("plan auto:")]
    assert "D=4" in why and "N=8" in why and "kept as given: micro_batches, stages" in why
    assert job.prediction is not None and job.prediction.source == "plan auto"
    losses = [m["loss"] for m in run_local(job).metrics]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)

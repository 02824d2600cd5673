"""How a profile was taken travels to the plan: the profile records how many processes ran at once
(``--concurrent``; old files read 1), and ``chimera plan`` says plainly when that differs from the workers that
will share a CPU machine (a ``trust`` line and field), which a job compiled from the plan carries to the run. The
profile and the plan are of the model training builds (the same default sequence length), and a plan made for
other shapes is refused before training."""

import argparse
import dataclasses
import json
import os

import pytest

from chimera.cli import main
from chimera.cli.common import add_model_args, model_of
from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.models import build_model
from chimera.plan import PlanFile
from chimera.plan.profiles import trust_note
from chimera.profile import Profile, ProfileError, fingerprint
from chimera.profile.synthetic import layer, profile
from ray_launch.command import _summary
from ray_launch.recovery import RunReport

pytestmark = pytest.mark.timeout(120)

SIZES = (2, 4)


def synthetic(concurrent: int = 1, threads: int = 1, device: str = "cpu", layers: int = 4) -> Profile:
    prof = profile([layer(i, 0.002, 10_000, 10_000, 1_000, SIZES) for i in range(layers)], SIZES)
    return dataclasses.replace(prof, concurrent=concurrent, threads=threads, device=device)


def test_the_profile_file_keeps_concurrent_and_an_old_file_reads_one(tmp_path):
    prof = synthetic(concurrent=3)
    loaded = Profile.load(prof.save(tmp_path / "p.json"))
    assert loaded == prof and loaded.concurrent == 3
    old = prof.to_dict()
    del old["concurrent"]  # a file written before the field existed
    assert Profile.from_dict(old).concurrent == 1
    for bad in (0, "2"):
        with pytest.raises(ProfileError, match="concurrent must be an integer >= 1"):
            Profile.from_dict({**old, "concurrent": bad})


def test_trust_says_when_fewer_processes_ran_than_workers_share_a_cpu_machine():
    note = trust_note(synthetic(concurrent=1), workers=2, cores=2)
    assert "ran 1 process at once; 2 workers will share" in note and "under-predicted (by ~2x or more)" in note
    assert note.endswith("re-profile with chimera profile --concurrent 2")
    assert "by ~4x or more" in trust_note(synthetic(concurrent=2), workers=8, cores=8)
    assert trust_note(synthetic(concurrent=2), workers=2, cores=2) == ""  # taken as the workers will run
    assert trust_note(synthetic(concurrent=2, threads=2), workers=4, nodes=2, cores=4) == ""  # 2 per machine
    assert trust_note(synthetic(concurrent=1, device="cuda"), workers=8) == ""  # one GPU each: nothing shared
    assert "2 workers will share one machine: step times are likely over-predicted" in trust_note(
        synthetic(concurrent=4), workers=2, cores=2)
    assert "cuda device of its own: step times are likely over-predicted; re-profile with chimera profile " \
           "--concurrent 1" in trust_note(synthetic(concurrent=2, device="cuda"), workers=8)
    threads = trust_note(synthetic(concurrent=2, threads=2), workers=2, cores=2)
    assert "ran 2 thread(s) per process" in threads and threads.endswith("--concurrent 2 --threads 1")


def _profile_of_bert(tmp_path, concurrent: int) -> str:
    """A synthetic profile that passes bert-tiny's check (its fingerprint and layer count), threads as a worker
    of two on this machine runs."""
    chain = build_model("bert-tiny", seq_len=8)
    prof = dataclasses.replace(synthetic(concurrent, max(1, (os.cpu_count() or 1) // 2), layers=chain.num_layers),
                               model=chain.name, fingerprint=fingerprint(chain))
    return str(prof.save(tmp_path / f"c{concurrent}.profile.json"))


@pytest.mark.parametrize("concurrent", [1, 2])
def test_chimera_plan_prints_and_writes_the_trust_line(concurrent, tmp_path, capsys):
    out = tmp_path / "plan.json"
    # --profile: the deprecated spelling of --profile-file, accepted too
    assert main(["plan", "--model", "bert-tiny", "--seq-len", "8", "--profile", _profile_of_bert(tmp_path, concurrent),
                 "--workers", "2", "--global-batch", "8", "-o", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    trust = [x for x in lines if x.startswith("trust: ")]
    saved = json.loads(out.read_text())["trust"]
    assert len(trust) == 1
    if concurrent == 1:
        assert "profile ran 1 process at once; 2 workers will share" in trust[0] and saved == trust[0][7:]
    else:
        assert trust[0] == "trust: profile taken as the workers will run (2 process(es) at once, " \
                           f"{max(1, (os.cpu_count() or 1) // 2)} thread(s) each)" and saved == ""
    job = compile_job(TrainConfig.from_flags(model="bert-tiny", seq_len=8, plan=str(out), steps=1,
                                             corpus="synthetic"))
    assert job.prediction is not None and job.prediction.trust == saved == PlanFile.load(out).trust
    # the run's summary: the note right under its measured / predicted line
    records = [{"loss": 1.0, "samples_per_s": 1.0, "step_time_s": 0.1}] * 3
    _summary(job, records, RunReport(), tmp_path / "m.jsonl", tmp_path / "c.toml")
    lines = capsys.readouterr().out.splitlines()
    ratio = next(i for i, x in enumerate(lines) if "measured / predicted" in x)
    assert lines[ratio + 1:] == ([f"  the plan's trust note: {saved}"] if saved else [])


def test_the_runs_measured_step_leaves_out_the_steps_that_record_a_timeline(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "bert-tiny", "--seq-len", "8", "--profile-file", _profile_of_bert(tmp_path, 2),
                 "--workers", "2", "--global-batch", "8", "-o", str(out)]) == 0
    job = compile_job(TrainConfig.from_flags(model="bert-tiny", seq_len=8, plan=str(out), steps=5, corpus="synthetic",
                                             profile=True, profile_steps=(2, 3)))
    times = [0.9, 0.1, 0.5, 0.5, 0.1]  # steps 2 and 3 recorded their events: slower
    records = [{"step": i, "loss": 1.0, "samples_per_s": 1.0, "step_time_s": t} for i, t in enumerate(times)]
    capsys.readouterr()
    _summary(job, records, RunReport(), tmp_path / "m.jsonl", tmp_path / "c.toml")
    line = next(x for x in capsys.readouterr().out.splitlines() if "measured / predicted" in x)
    assert "measured 0.1 s (median of 2 steps after the first that recorded no timeline" in line


def test_chimera_plan_refuses_bad_nodes_and_a_missing_profile(tmp_path, capsys):
    assert main(["plan", "--model", "bert-tiny", "--workers", "2"]) == 2
    assert "--profile-file is required" in capsys.readouterr().err
    assert main(["plan", "--model", "bert-tiny", "--profile-file", "x.json", "--workers", "2", "--nodes", "3"]) == 2
    assert "need 1 <= --nodes <= --workers (2)" in capsys.readouterr().err


def test_profile_and_plan_default_to_the_sequence_length_training_builds():
    """Without --seq-len, chimera profile and chimera plan build the model training builds (its fingerprint): a
    profile of another length times other shapes (the preset's 128 tokens took twice training's 64)."""
    args = argparse.Namespace(model="bert-tiny", chain=None, seq_len=None, vocab_shards=1)
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    defaults = parser.parse_args(["--model", "bert-tiny"])
    trained = compile_job(TrainConfig.from_flags(model="bert-tiny", steps=1, corpus="synthetic")).chain
    assert model_of(defaults).fingerprint() == trained.fingerprint()
    assert model_of(args).fingerprint() != trained.fingerprint()  # the preset's own length differs


def test_a_plan_for_another_sequence_length_is_refused_before_training(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "bert-tiny", "--seq-len", "8", "--profile", _profile_of_bert(tmp_path, 2),
                 "--workers", "2", "--global-batch", "8", "-o", str(out)]) == 0
    assert PlanFile.load(out).tokens_per_sample == 8
    with pytest.raises(ConfigError, match="at 8 tokens per sample and this run has 16: train with --seq-len 8, or "
                                          "profile and plan again with --seq-len 16"):
        compile_job(TrainConfig.from_flags(model="bert-tiny", seq_len=16, plan=str(out), steps=1, corpus="synthetic"))
    saved = json.loads(out.read_text())
    saved["tokens_per_sample"] = None  # a plan written before the field: the fingerprint still tells
    out.write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match="whose layers or the shapes between them differ from this run's"):
        compile_job(TrainConfig.from_flags(model="bert-tiny", seq_len=16, plan=str(out), steps=1, corpus="synthetic"))


def test_a_run_that_clips_otherwise_than_the_plan_priced_is_told(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "bert-tiny", "--seq-len", "8", "--profile", _profile_of_bert(tmp_path, 2),
                 "--workers", "2", "--global-batch", "8", "-o", str(out)]) == 0
    assert PlanFile.load(out).clip_grad == 1.0  # training's default, priced
    same = compile_job(TrainConfig.from_flags(model="bert-tiny", seq_len=8, plan=str(out), steps=1, corpus="synthetic"))
    assert same.prediction is not None and same.prediction.trust == ""
    other = compile_job(TrainConfig.from_flags(model="bert-tiny", seq_len=8, plan=str(out), steps=1, clip_grad=0.0,
                                               corpus="synthetic"))
    assert other.prediction is not None and other.prediction.trust == (
        "the plan priced clipping by the global gradient norm and this run has --clip-grad 0: plan with "
        "--clip-grad 0 for its step time")


def test_plan_records_post_validation_and_a_run_that_adds_it_is_told(tmp_path):
    """``chimera plan --post-validate`` records that it priced the rollback copies; a post-validated run of a plan
    made without the flag is told that its memory lacks them."""
    prof = _profile_of_bert(tmp_path, 2)
    for flag, name in ((True, "pv.json"), (False, "plain.json")):
        out = tmp_path / name
        assert main(["plan", "--model", "bert-tiny", "--seq-len", "8", "--profile", prof, "--workers", "2",
                     "--global-batch", "8", "-o", str(out), *(["--post-validate"] if flag else [])]) == 0
        chosen = PlanFile.load(out)
        assert chosen.post_validate is flag
        run = compile_job(TrainConfig.from_flags(model="bert-tiny", seq_len=8, plan=str(out), steps=1,
                                                 corpus="synthetic", post_validate=True))
        assert run.prediction is not None
        assert ("no --post-validate rollback copies" in run.prediction.trust) is not flag, run.prediction.trust
    peaks = [PlanFile.load(tmp_path / name).peak_memory_bytes for name in ("pv.json", "plain.json")]
    assert peaks[0] >= peaks[1], peaks  # the copies raise it where they are the peak (test_post_validate.py)


def test_a_plan_for_overlapping_steps_predicts_the_period(tmp_path, capsys, monkeypatch):
    """Training without a global norm at a step's end (``--clip-grad 0``, or ``--post-validate``) overlaps its
    steps, so ``chimera plan`` ranks its top rows by the steady state's period (each simulated for 6 overlapped
    steps on its lowered schedule) and predicts that, unless the schedules are too large to simulate so quickly;
    with clipping drained, one step's makespan."""
    from chimera.plan import plan
    from chimera.plan.period import by_period

    prof = _profile_of_bert(tmp_path, 2)
    loaded = Profile.load(prof)
    for clip, post in ((0.0, False), (1.0, True), (1.0, False)):
        out = tmp_path / f"{clip}-{post}.json"
        assert main(["plan", "--model", "bert-tiny", "--seq-len", "8", "--profile", prof, "--workers", "2",
                     "--global-batch", "8", "--clip-grad", str(clip), "-o", str(out),
                     *(["--post-validate"] if post else [])]) == 0
        said = capsys.readouterr().out
        result = plan(loaded, 2, 8, None, "lamb", clip=clip > 0, post_validated=post)
        if clip == 0 or post:
            top = by_period(result.ranked[:10], loaded, "lamb", clip > 0, post)
            assert "the period of 6 overlapped steps" in said
            assert top[0].step_s <= result.ranked[0].step_s * (1 + 1e-9)
        else:
            top = result.ranked
            assert "overlapped" not in said
        assert PlanFile.load(out).predicted_step_s == pytest.approx(top[0].step_s, rel=1e-12), (clip, post)
    # schedules too large to simulate over 6 steps quickly keep one step's figure, and the table says so
    import chimera.plan.period

    monkeypatch.setattr(chimera.plan.period, "PERIOD_BUDGET", 1)
    out = tmp_path / "large.json"
    assert main(["plan", "--model", "bert-tiny", "--seq-len", "8", "--profile", prof, "--workers", "2",
                 "--global-batch", "8", "--clip-grad", "0", "-o", str(out)]) == 0
    assert "too large to simulate" in capsys.readouterr().out
    one_step = plan(loaded, 2, 8, None, "lamb", clip=False).ranked[0].step_s
    assert PlanFile.load(out).predicted_step_s == pytest.approx(one_step, rel=1e-12)


def test_chimera_profile_times_layers_as_the_probe_workers_run_unless_told():
    from chimera.cli.profile import default_concurrent

    assert default_concurrent("cpu", "local", 2) == 2  # the documented profile: as the two workers will run
    assert default_concurrent("cpu", "local", 4) == 4
    assert default_concurrent("cpu", "none", 4) == 1  # no local probe: nothing says how many share the cores
    assert default_concurrent("cuda", "local", 4) == 1  # one GPU per worker: nothing shared

"""Timelines: one event per action, Chrome trace, figure rows, summary bubble, single-byte mode, Nsight."""

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chimera.cli import main as cli_main
from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.runtime import run_local
from chimera.timeline.analysis import step_stats
from chimera.timeline.nsight import events_from_nsys_sqlite
from chimera.timeline.report import load_events, render, timeline_figure, write_profile

#: a hang fails a test here within this many seconds (pytest-timeout), not at CI's limit
pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
CFG = TrainConfig.from_flags(model="bert-tiny", schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2, seq_len=16,
                  steps=3, optimizer="adamw", timeout_s=60, profile=True, profile_steps=(1, 2), corpus="synthetic", partition="uniform")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    plan = compile_job(CFG)
    res = run_local(plan)
    out = tmp_path_factory.mktemp("profiles")
    meta = {"comm_payload": "full", "training_result": True}
    paths = write_profile(plan.name, res.events, plan.schedule, plan.world_size, meta, out)
    return res, plan, paths


def test_one_event_per_action_in_list_order(profiled):
    res, plan, _ = profiled
    assert {e.iteration for e in res.events} == {1, 2}
    for it in (1, 2):
        for rank in range(plan.world_size):
            evs = [e for e in res.events if e.worker == rank and e.iteration == it]
            acts = plan.schedule.actions[rank % plan.schedule.workers]
            assert [(e.kind, e.pipe, e.stage, e.microbatch) for e in evs] == \
                   [(a.kind.value, a.pipe, a.stage, a.microbatch) for a in acts]
            assert all(e.end >= e.start for e in evs)
            # sequential on a worker; the actions of one communication batch share its interval
            assert all(a.end <= b.start + 1e-9 or (a.start, a.end) == (b.start, b.end) for a, b in zip(evs, evs[1:]))


def test_chrome_trace_has_what_perfetto_needs(profiled):
    res, plan, paths = profiled
    trace = json.loads(paths["trace"].read_text())
    evs = trace["traceEvents"]
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == len(res.events)
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) for e in xs)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    names = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {w: f"worker {w}" for w in range(plan.world_size)}
    assert {e["tid"] for e in xs} == {0, 1}  # one thread per pipe
    assert "d0F0" in {e["name"] for e in xs}


def test_figure_rows_and_files(profiled):
    res, plan, paths = profiled
    assert paths["png"].stat().st_size > 20_000 and paths["pdf"].stat().st_size > 5_000
    summary = json.loads(paths["summary"].read_text())
    fig = timeline_figure(res.events, plan.schedule, plan.world_size, summary)
    measured, predicted = fig.axes[:2]
    assert len(measured.get_yticks()) == plan.world_size == len(predicted.get_yticks())
    assert [t.get_text() for t in measured.get_yticklabels()] == ["worker 1", "worker 0"]
    assert "utilization" in measured.get_title() and "mean iteration" in measured.get_title()
    assert measured.get_legend() is not None


def test_summary_bubble_matches_events(profiled):
    """The summary's numbers computed here from the events themselves: an iteration spans its first start to its
    last end on any worker; a worker is busy during its forwards and backwards; the bubble is the idle share."""
    res, plan, paths = profiled
    summary = json.loads(paths["summary"].read_text())
    spans, idle, busy = [], [], {w: 0.0 for w in range(plan.world_size)}
    for it in (1, 2):
        evs = [e for e in res.events if e.iteration == it]
        span = max(e.end for e in evs) - min(e.start for e in evs)
        work = {w: sum(e.end - e.start for e in evs if e.worker == w and e.kind in ("F", "B")) for w in busy}
        spans.append(span)
        idle.append(1 - sum(work.values()) / (plan.world_size * span))
        busy = {w: busy[w] + work[w] / 2 for w in busy}
    assert {e.kind for e in res.events} >= {"F", "B", "SEND_F", "RECV_F", "AR_START"}  # more than compute
    assert summary["iteration_s"] == pytest.approx(spans, rel=1e-12)
    assert summary["mean_iteration_s"] == pytest.approx(sum(spans) / 2, rel=1e-12)
    assert summary["measured_bubble"] == pytest.approx(sum(idle) / 2, abs=1e-12)
    assert {int(w): b for w, b in summary["busy_s"].items()} == pytest.approx(busy, rel=1e-12)
    assert 0 < summary["measured_bubble"] < 1 and summary["replayed_iteration_s"] > 0


def test_compute_window_leaves_out_the_gradient_sum_and_the_optimizer():
    from chimera.timeline import Event

    evs = [Event(0, "RECV_F", "down", 0, 0, 0.0, 0.5), Event(0, "F", "down", 0, 0, 0.5, 1.5),
           Event(1, "F", "down", 1, 0, 1.5, 2.5), Event(1, "B", "down", 1, 0, 2.5, 4.5),
           Event(0, "B", "down", 0, 0, 4.5, 6.5), Event(0, "ALLREDUCE_WAIT", "down", 0, -1, 6.5, 7.0),
           Event(1, "OPTIMIZER_STEP", "down", -1, -1, 6.5, 8.5)]
    whole, window = step_stats(evs)[0], step_stats(evs, compute_only=True)[0]
    assert whole.makespan == 8.5 and window.makespan == 6.0 and whole.busy == window.busy == {0: 3.0, 1: 3.0}
    assert window.bubble == 0.5 and whole.bubble == pytest.approx(1 - 6 / 17)


def test_single_byte_mode_counts_one_byte_payloads(tmp_path):
    cfg = CFG.with_flags(comm_payload="single-byte", data_parallel=2, steps=2, profile_steps=(1,))
    res = run_local(compile_job(cfg))
    for m in res.metrics:
        assert m["payload_sizes"] and set(m["payload_sizes"]) == {"1"}
        assert m["training_result"] is False and m["comm_bytes"] == m["comm_messages"]
    full = run_local(compile_job(cfg.with_flags(comm_payload="full", profile=False)))
    assert all(int(k) > 1 for k in full.metrics[0]["payload_sizes"])
    plan = compile_job(cfg)
    paths = write_profile(plan.name, res.events, plan.schedule, plan.world_size,
                          {"comm_payload": "single-byte", "training_result": False}, tmp_path)
    summary = json.loads(paths["summary"].read_text())
    assert summary["training_result"] is False
    fig = timeline_figure(res.events, plan.schedule, plan.world_size, summary)
    assert "NOT a training result" in fig.axes[0].get_title()


def _nsys_db(path: Path, events_path: Path) -> None:
    """A small SQLite with the NVTX / CUDA runtime / kernel tables of an nsys export."""
    evs, _, _, _ = load_events(events_path)
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
            rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER,
            textId INTEGER, domainId INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
            eventClass INTEGER, globalTid INTEGER, correlationId INTEGER, nameId INTEGER, returnValue INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER,
            contextId INTEGER, streamId INTEGER, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER,
            shortName INTEGER);
    """)
    corr = 0
    for k, e in enumerate(evs):
        pid = (1000 + e.worker) << 24
        tid = pid + 7
        start, end = int(e.start * 1e9), int(e.end * 1e9)
        name = f"{e.pipe[0]}{e.stage}{'F' if e.kind == 'F' else 'B'}{e.microbatch} [w{e.worker} it{e.iteration}]"
        if e.kind not in ("F", "B"):
            continue
        con.execute("INSERT INTO StringIds VALUES (?, ?)", (k + 1, name))
        con.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, textId, globalTid) VALUES (?, ?, 59, ?, ?)",
                    (start, end, k + 1, tid))
        for j in range(2):  # two launches per range; kernels run 1 ms after the launch
            corr += 1
            t = start + j * 10
            con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME (start, end, globalTid, correlationId) "
                        "VALUES (?, ?, ?, ?)", (t, t + 5, tid, corr))
            con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, correlationId, globalPid) "
                        "VALUES (?, ?, ?, ?)", (t + 1_000_000, t + 1_500_000, corr, pid))
    con.commit()
    con.close()


def test_plot_from_nsight_sqlite(profiled, tmp_path, capsys):
    _, _, paths = profiled
    db = tmp_path / "run.sqlite"
    _nsys_db(db, paths["events"])
    gpu = events_from_nsys_sqlite(db)
    cpu = [e for e in load_events(paths["events"])[0] if e.kind in ("F", "B")]
    assert len(gpu) == len(cpu)
    for g, c in zip(sorted(gpu, key=lambda e: e.start), sorted(cpu, key=lambda e: e.start)):
        assert g.start == pytest.approx(c.start + 1e-3, abs=1e-6)  # kernel time, not the NVTX (CPU) time
        assert g.end == pytest.approx(c.start + 1e-3 + 0.5e-3 + 10e-9, abs=1e-6)
    code = cli_main(["timeline", "plot", str(paths["events"]), "--sqlite", str(db)])
    assert code == 0 and "png" in capsys.readouterr().out
    out = render(paths["events"], tmp_path / "re")
    assert out["png"].exists()


#: the scripts run ``python`` from PATH: the one running the tests comes first
SCRIPT_ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_plot_script_rebuilds_from_saved_events(profiled):
    _, plan, paths = profiled
    paths["png"].unlink()
    p = subprocess.run(["bash", "scripts/plot_cuda_timeline.sh", plan.name, "--dir", str(paths["png"].parent)],
                       cwd=ROOT, env=SCRIPT_ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert paths["png"].exists()


def test_plot_script_under_sh_replots_the_newest_without_name(profiled, tmp_path):
    _, _, paths = profiled
    runs = tmp_path / "runs"
    runs.mkdir()
    saved = json.loads(paths["events"].read_text())
    for name, age in (("older", 100), ("newer", 0)):
        f = runs / f"{name}.events.json"
        f.write_text(json.dumps({**saved, "meta": {**saved["meta"], "name": name}}))
        os.utime(f, (time.time() - age, time.time() - age))
    script = str(ROOT / "scripts" / "plot_cuda_timeline.sh")
    p = subprocess.run(["sh", script, "--dir", "runs"], cwd=tmp_path, env=SCRIPT_ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "no NAME given: re-plotting the newest, runs/newer.events.json" in p.stderr
    assert (runs / "newer.png").exists() and not (runs / "older.png").exists()
    p = subprocess.run(["sh", script, "older", "--dir=runs"], cwd=tmp_path, env=SCRIPT_ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and (runs / "older.png").exists(), p.stderr
    p = subprocess.run(["sh", script, "--dir", str(tmp_path)], env=SCRIPT_ENV, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and f"no *.events.json in {tmp_path}; profile a run with --profile" in p.stderr


@pytest.mark.slow
def test_nsys_starts_actors_under_nsight_or_fails_fast(local_script_run, monkeypatch):
    run = local_script_run  # the default script with --nsys, under a stand-in nsys (tests/procs.py)
    assert run.returncode == 0, run.output[-3000:]
    workers = [c for c in run.nsys_calls if "default_worker.py" in c]
    assert len(workers) >= 2 and all(c.startswith("profile") and "-t cuda,cudnn,cublas,nvtx" in c for c in workers)
    assert all(str(run.run_dir) in c for c in workers)  # the run's directory: next to its metrics
    # without nsys on PATH: refused by the job's constructor, before Ray starts (the CLI maps ConfigError to exit 2)
    from ray_launch.driver import RayJob

    no_nsys = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nsys").exists())
    monkeypatch.setenv("PATH", no_nsys)
    cfg = TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=2, seq_len=16, corpus="synthetic",
                                 partition="uniform", nsys=True)
    with pytest.raises(ConfigError, match="--nsys needs Nsight Systems' `nsys` on PATH"):
        RayJob(compile_job(cfg))

"""Smoke test of bench/vs_torch_pipelining.py: one repetition of the smallest workload, every row produced.

No timing assertions: the figures depend on the machine.
"""

import importlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from chimera.compile import compile_job

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
KEYS = {"workload", "system", "schedule", "stages", "micro_batches", "median_step_s", "ratio_to_torch_1f1b",
        "ratio_to_torch_best", "predicted_step_s"}
SMOKE = ("zbvzerobubble", "dualpipev", "chimera", "auto")  # the CI smoke rows, with torch.pp 1F1B (the reference)
TORCH = ("gpipe", "1f1b", "interleaved1f1b", "dualpipev", "zbvzerobubble", "interleavedzerobubble", "loopedbfs")


def test_vs_torch_pipelining_smoke(tmp_path):
    out, md = tmp_path / "rows.json", tmp_path / "RESULTS.md"
    md.write_text("# Benchmark results\n\n## Earlier section\n\nkept\n")
    cmd = [sys.executable, "bench/vs_torch_pipelining.py", "--quick", "--workloads", "delay-d4-n4", "--tf", "0.01",
           "--schedules", ",".join(SMOKE), "--json", str(out), "--results", str(md)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    got = {(r["system"], r["schedule"]) for r in rows}
    auto = [r["schedule"] for r in rows if r["schedule"].startswith("auto: ")]
    assert auto == ["auto: chimera4"]  # labelled with its choice (over the 2·D-block split torch.pp's 2-stage rows run)
    assert got == {("torch.pp", s) for s in TORCH if s in (*SMOKE, "1f1b")} | {("chimera", "chimera"), ("chimera", auto[0])}
    best = min(r["median_step_s"] for r in rows if r["system"] == "torch.pp" and r["median_step_s"])
    assert all(r["ratio_to_torch_best"] == r["median_step_s"] / best for r in rows if r["median_step_s"])
    for r in rows:
        assert set(r) >= KEYS
        assert (r["workload"], r["stages"], r["micro_batches"]) == ("delay-d4-n4", 4, 4)
        if r["note"]:  # infeasible for torch (DualPipeV needs N >= 2D): reported, not run
            assert r["median_step_s"] is None
        else:
            assert r["median_step_s"] > 0 and r["ratio_to_torch_1f1b"] > 0
    assert any(r["note"] for r in rows if r["schedule"] == "dualpipev")
    # torch's own compute order (rank 0's pipeline_order), simulated like chimera's schedules: ZBV's ideal step
    zbv = next(r for r in rows if r["schedule"] == "zbvzerobubble")
    assert zbv["predicted_step_s"] == pytest.approx(15 * 0.01), zbv  # 12 tf of work per rank, 3 tf of bubble
    # chimera's rows: predicted with the runtime's costs, calibrated for the workload once its rows were up
    assert "- calibration, delay-d4-n4 (its rows up: before their steps): ping-pong one way" in proc.stdout
    assert "delay-d4-n4: calibration in " in proc.stderr and "(before the rows)" in proc.stderr
    assert "(after the rows)" not in proc.stderr  # --quick: one calibration
    from bench.chimera_runner import chimera_config
    from bench.predict import predicted_step_s
    from bench.workloads import WORKLOADS
    w = replace(WORKLOADS["delay-d4-n4"], tf=0.01)
    bare = predicted_step_s(w, "chimera", "chimera", compile_job(chimera_config(w, "chimera", 6)).schedule, run=5)
    chim = next(r for r in rows if (r["system"], r["schedule"]) == ("chimera", "chimera"))
    assert chim["predicted_step_s"] > bare, (chim, bare)  # per-action and per-step costs on top of the sleeps
    text = md.read_text()
    assert "predicted " in text.split("auto: chimera4 / best torch.pp")[1].splitlines()[0]
    assert "## Earlier section" in text and "kept" in text
    assert "## chimera vs torch.distributed.pipelining" in text and "--workloads delay-d4-n4" in text
    for r in rows:
        assert f"| {r['workload']} | {r['system']} | {r['schedule']} |" in text
        assert f"| {r['workload']} | {r['system']} | {r['schedule']} |" in proc.stdout


def test_planned_split_is_the_same_on_both_systems():
    """A planned workload hands its split to chimera's --partition and to torch.pp's stage builder alike."""
    from bench.chimera_runner import chimera_config
    from bench.workloads import WORKLOADS

    w = WORKLOADS["bert-d2-n4-planned"]
    model = w.build(2)
    with pytest.raises(ValueError, match="with_plan"):
        w.layers(model, 2)
    w = replace(w, planned=((2, (3, 1)), (4, (1, 1, 1, 1))))
    assert w.layers(model, 2) == [[0, 1, 2], [3]]
    job = compile_job(chimera_config(w, "1f1b", 2))
    assert job.stage_layers == w.layers(model, 2)
    assert WORKLOADS["bert-d2-n4"].layers(model, 2) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("script", sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__"))
def test_every_bench_script_imports(script):
    """Every bench script and helper imports against today's package (their imports are at module level, so a
    renamed module or name fails here rather than twenty minutes into a benchmark)."""
    importlib.import_module(f"bench.{script}")


def test_a_row_named_at_gloo_runs_its_schedule_with_messages_through_gloo():
    from bench.chimera_runner import chimera_config, row_p2p
    from bench.vs_torch_pipelining import rows_of
    from bench.workloads import WORKLOADS

    w = WORKLOADS["delay-d4-n4"]
    assert row_p2p("1f1b@gloo") == ("1f1b", "gloo") and row_p2p("1f1b") == ("1f1b", "auto")
    with pytest.raises(SystemExit, match="only 'gloo'"):
        row_p2p("1f1b@nccl")
    rows = {(r["system"], r["schedule"]): r for r in rows_of(w, {"1f1b", "1f1b@gloo"})}
    assert rows[("chimera", "1f1b@gloo")]["split"] == rows[("chimera", "1f1b")]["split"]
    assert compile_job(chimera_config(w, "1f1b", 6, p2p="gloo")).run.p2p == "gloo"
    assert compile_job(chimera_config(w, "1f1b", 6)).run.p2p == "auto"


def test_a_row_is_priced_with_the_calibration_run_of_its_backward():
    """``Calibration.costs``: a whole-backward schedule takes the whole-backward run's costs, a split one the split
    run's (where workers share cores, a split backward's actions wait longer for theirs)."""
    from bench.predict import Calibration, RuntimeCosts
    from chimera.schedule import build_schedule, lower
    from chimera.schedule.lowering import split_backward

    c = Calibration(1e-5, RuntimeCosts((("F", 1e-4), ("B", 2e-4)), 1e-3), RuntimeCosts((("F", 4e-4),), 2e-3))
    whole = lower(build_schedule("1f1b", 4, 8))
    split = lower(split_backward(build_schedule("1f1b", 4, 8)))
    assert c.costs(0.002, whole).fixed == (("F", 1e-4), ("B", 2e-4))
    assert c.costs(0.002, split).fixed == (("F", 4e-4),)
    assert c.costs(0.002, split).optimizer - c.costs(0.002, whole).optimizer == pytest.approx(1e-3)  # its step


def test_a_row_whose_workers_share_cores_is_priced_with_their_turns():
    """``Calibration.cores`` (four workers on two cores, as the runtime pins them): Chimera's workers 0 and 2 both
    compute at once, so its rows are predicted longer than with a core each; only the runtime's own time holds a
    core (the delay model's compute sleeps)."""
    from bench.predict import Calibration, RuntimeCosts
    from chimera.schedule import build_schedule, lower, simulate

    own = RuntimeCosts((("F", 3e-4), ("B", 4e-4), ("SEND_F", 6e-5), ("SEND_B", 6e-5)))
    alone, shared = Calibration(3e-5, own, own), Calibration(3e-5, own, own, cores=(0, 1, 0, 1))
    sched = lower(build_schedule("chimera", 4, 8))
    costs = shared.costs(0.0005, sched)
    assert (costs.cores, costs.cpu_compute) == ((0, 1, 0, 1), False)
    longer = simulate(sched, costs).makespan - simulate(sched, alone.costs(0.0005, sched)).makespan
    assert 0 < longer < 8 * 7e-4  # some turns waited, far fewer than every action's

"""The chimera command line: output formats, simulate JSON, plot, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from chimera.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_show_json_in_execution_order(capsys):
    code, out, _ = run(capsys, "schedule", "show", "chimera", "--stages", "4", "--micro-batches", "8", "--format", "json")
    assert code == 0
    d = json.loads(out)
    assert len(d["workers"]) == 4
    assert d["workers"][0][:2] == [{"kind": "F", "pipe": "down", "stage": 0, "microbatch": 0},
                                   {"kind": "F", "pipe": "down", "stage": 0, "microbatch": 1}]
    assert {a["kind"] for w in d["workers"] for a in w} == {"F", "B"}
    code, out, _ = run(capsys, "schedule", "show", "1f1b", "-D", "2", "-N", "2", "--format", "json", "--lowered")
    kinds = {a["kind"] for w in json.loads(out)["workers"] for a in w}
    assert {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "OPT"} <= kinds  # the codes of the text form, everywhere


def test_show_text_and_csv(capsys):
    _, out, _ = run(capsys, "schedule", "show", "chimera", "-D", "4", "-N", "4")
    assert "0: d0F0 d0F1 u3F0 u3B0 u3F1 u3B1 d0B0 d0B1" in out
    _, out, _ = run(capsys, "schedule", "show", "gpipe", "-D", "2", "-N", "2", "--format", "csv")
    assert out.splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1F1,1B0,1B1"]


def test_simulate_json(capsys):
    code, out, _ = run(capsys, "schedule", "simulate", "chimera", "-D", "4", "-N", "4", "--fwd", "1", "--bwd", "2", "--json")
    d = json.loads(out)
    assert code == 0 and d["makespan"] == 16 and d["peak_activations"] == [3, 4, 4, 3]
    assert d["busy"] == [12, 12, 12, 12] and d["bubble"] == pytest.approx(0.25)
    _, out, _ = run(capsys, "schedule", "simulate", "1f1b", "-D", "4", "-N", "4")
    assert "makespan          21" in out


def test_plot_writes_png(capsys, tmp_path):
    target = tmp_path / "c.png"
    code, out, _ = run(capsys, "schedule", "plot", "chimera", "-D", "4", "-N", "8", "-o", str(target))
    assert code == 0 and target.stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["chimera", "-D", "3", "-N", "3"], "even number of --stages"),
        (["chimera", "-D", "4", "-N", "6"], "multiple of --stages"),
        (["gpipe", "-D", "4", "-N", "0"], "--micro-batches must be >= 1"),
        (["pipedream", "-D", "4", "-N", "4"], "unknown schedule 'pipedream'; allowed: gpipe, 1f1b, interleaved, chimera"),
        (["interleaved", "-D", "4", "-N", "8", "--chunks", "0"], "--chunks (v) must be >= 1"),
        (["gpipe", "-D", "x", "-N", "4"], "invalid int value"),
    ],
)
def test_bad_arguments_one_line_exit_2(capsys, argv, msg):
    code, out, err = run(capsys, "schedule", "show", *argv)
    assert code == 2
    assert msg in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_console_script_exit_code_no_traceback():
    p = subprocess.run([sys.executable, "-m", "chimera.cli", "schedule", "show", "chimera", "-D", "5", "-N", "5"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "even number" in p.stderr


def test_simulate_does_not_validate_a_generated_schedule_twice(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr("chimera.cli.schedule.validate", lambda s: calls.append(s.name) or s)
    run(capsys, "schedule", "simulate", "chimera", "-D", "4", "-N", "4", "--lowered", "--json")
    assert calls == []  # the simulator itself reports a deadlock, with the grid
    run(capsys, "schedule", "show", "chimera", "-D", "4", "-N", "4", "--lowered")
    assert calls == ["chimera"]


def test_schedule_commands_do_not_import_torch():
    code = ("import sys; from chimera.cli import main; main(['schedule', 'simulate', '1f1b', '-D', '2', '-N', '2']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_tokenizer_family_choices(capsys):
    code, _, err = run(capsys, "data", "tokenizer", "corpus.txt", "--family", "bert", "t5")
    assert code == 2 and "invalid choice: 't5' (choose from 'bert', 'gpt2')" in err


def test_train_hands_every_flag_to_the_compiler(capsys):
    """``chimera train --model ...`` (the console script: chimera's commands and the Ray layer's ``train``) reaches
    the compiler's checks, which name the flag and the presets."""
    from ray_launch.cli import main as console

    code = console(["train", "--model", "no-such-model", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "unrecognized arguments" not in err
    assert "--model must be one of bert-48, bert-base" in err and "got 'no-such-model'" in err

"""A new schedule is one registry entry; a new action kind is a row, a handler and a cost: registered from outside
the package (``tests/toy_extension.py``), they are built, validated, simulated, lowered, shown and trained to
parity with sequential training, with nothing else changed."""

import pytest
import toy_extension
from toy_extension import NOTE, NOTE_S

from chimera.cli import main as cli_main
from chimera.compile import compile_job
from chimera.config import TrainConfig
from chimera.plan.memory import MemoryWalk
from chimera.runtime import run_local, stage_params_by_layer, train_sequential
from chimera.schedule import Action, Costs, build_schedule, lower, simulate, validate
from chimera.schedule.registry import SCHEDULES, candidates


def test_the_toy_schedule_and_kind_pass_through_every_pass(capsys):
    s = build_schedule("eager-1f1b", 4, 8)
    validate(s)
    assert Action.parse("d2NOTE") == Action(NOTE, "down", 2)  # the text form knows the new code
    base = simulate(lower(s), Costs(fwd=1, bwd=2)).makespan
    assert simulate(lower(s), Costs(fwd=1, bwd=2, extra=(("note", 5),))).makespan == base + 5  # its cost, charged
    assert MemoryWalk(lower(s)).workers  # the memory model walks it (its row: no effect)
    assert "eager-1f1b" in SCHEDULES and "eager-1f1b" not in {spec.name for _, spec, _ in candidates(4, 8)}
    assert cli_main(["schedule", "show", "eager-1f1b", "-D", "2", "-N", "2"]) == 0
    assert "1NOTE" in capsys.readouterr().out


def test_the_toy_schedule_and_kind_train_like_sequential():
    cfg = TrainConfig.from_flags(model="bert-tiny", corpus="synthetic", seq_len=16, micro_batch_size=2,
                                 schedule="eager-1f1b", stages=2, micro_batches=4, steps=2, optimizer="adamw",
                                 partition="uniform", profile=True)
    job = compile_job(cfg)
    res = run_local(job, return_state=True)
    ref = train_sequential(job)
    for m, r in zip(res.metrics, ref.losses):
        assert abs(m["loss"] - r) <= 1e-6
    for state in res.states.values():
        for (_, stage), params in state.items():
            for k, v in stage_params_by_layer(params, job.stage_layers[stage]).items():
                assert (v - ref.params[k]).abs().max().item() <= 1e-5, k
    notes = [e for e in res.events if e.kind == "NOTE"]  # the handler ran in the workers, where it was imported
    assert len(notes) == 2 * 2 and all(e.duration >= NOTE_S * 0.9 for e in notes)


def test_a_kind_without_a_handler_is_refused_before_the_first_step(monkeypatch):
    from chimera.runtime import handlers

    monkeypatch.delitem(handlers.HANDLERS, NOTE.value)  # its module is imported already: nothing registers it again
    assert toy_extension.NOTE.spec.module == "toy_extension"
    with pytest.raises(RuntimeError, match="no handler for action kind\\(s\\) NOTE"):
        handlers.handlers_for(type("W", (), {"name": "worker 0"})(), [NOTE])

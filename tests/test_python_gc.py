"""Python's garbage collector runs between a worker's steps, never inside one (``--python-gc step``)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from chimera.compile import compile_job
from chimera.config import TrainConfig
from chimera.runtime import PipelineWorker
from chimera.util.host_memory import StepCollector


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture
def collections():
    """Every collection Python starts while the test runs, as a list of generations."""
    seen: list[int] = []

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(cb)
    yield seen
    gc.callbacks.remove(cb)


def test_step_collector_collects_only_when_asked_and_gives_the_collector_back(collections):
    was = gc.isenabled()
    with StepCollector() as c:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        collections.clear()
        cyclic = _Node()
        ref = weakref.ref(cyclic)
        del cyclic
        junk = [[_Node()] for _ in range(50_000)]  # far past every automatic threshold
        del junk
        assert collections == [] and ref() is not None  # nothing collected inside the "step"
        assert c.after_step() > 0 and ref() is None  # collected after it
        assert collections == [2]
    assert gc.isenabled() == was and gc.get_freeze_count() == 0


def test_step_collector_disabled_leaves_python_alone():
    was = gc.isenabled()
    with StepCollector(enabled=False) as c:
        assert gc.isenabled() == was and c.after_step() == 0.0


def _train(mode: str, rendezvous: Path) -> tuple[list[float], int, int, list[float]]:
    """Three steps of a one-worker BERT-tiny job in this process: losses, collections inside and outside steps,
    and each step's reported collection seconds."""
    cfg = TrainConfig.from_flags(model="bert-tiny", schedule="1f1b", stages=1, micro_batches=4, steps=3, threads=1,
                                 python_gc=mode, corpus="synthetic", partition="uniform")
    w = PipelineWorker(compile_job(cfg), 0, 1, f"file://{rendezvous}")  # as run_local joins
    w.setup()
    inside = [0, 0]

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            inside[w.executor.at is None] += 1

    gc.callbacks.append(cb)
    try:
        results = [w.train_step(k) for k in range(3)]
    finally:
        gc.callbacks.remove(cb)
        w.close()
    return [r.loss_sum for r in results], inside[0], inside[1], [r.gc_s for r in results]


def test_worker_collects_between_steps_only(tmp_path):
    auto_losses, auto_inside, _, auto_gc = _train("auto", tmp_path / "auto")
    assert auto_inside > 0, "Python's automatic collector never ran inside a step: this test shows nothing"
    assert auto_gc == [0.0, 0.0, 0.0]
    losses, inside, outside, gc_s = _train("step", tmp_path / "step")
    assert inside == 0 and outside == 3  # one collection after each step
    assert all(s > 0 for s in gc_s)
    assert losses == auto_losses  # the same training, bit for bit
    assert gc.isenabled() and gc.get_freeze_count() == 0

"""Workers' cores (``--cpu-affinity``): where a host's workers fill its cores, each is pinned to its own, round robin
by rank (pipeline neighbours on different cores); ``off``, or fewer workers than cores, leaves them to the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import chimera
import chimera.util.cores as cores_module
from chimera.util.cores import core_sets, shared_cores, usable_cores


def test_core_sets_round_robin_where_the_workers_fill_the_cores():
    assert core_sets([0, 1], 4, 1) == [{0}, {1}, {0}, {1}]
    assert core_sets([2, 5], 3, 1) == [{2}, {5}, {2}]  # the usable cores, whatever their numbers
    assert core_sets([0, 1, 2, 3], 2, 2) == [{0, 1}, {2, 3}]
    assert core_sets([0, 1, 2, 3], 3, 2) == [{0, 1}, {2, 3}, {0, 1}]
    assert core_sets([0, 1], 1, 4) == [{0, 1}]  # more threads than cores: all of them
    assert core_sets([0, 1, 2, 3], 2, 1) is None  # cores to spare: the kernel places them
    assert core_sets([], 4, 1) is None


def test_shared_cores_names_each_worker_s_core_only_where_workers_share_them(monkeypatch):
    """What the simulator's ``Costs.cores`` gets: the runtime's pinning where some worker shares its core, else ()."""
    monkeypatch.setattr(cores_module, "usable_cores", lambda: [3, 7])
    assert shared_cores(4) == (3, 7, 3, 7)
    assert shared_cores(3) == (3, 7, 3)
    assert shared_cores(2) == () and shared_cores(1) == ()  # a core each


def test_pin_process_pins_the_threads_started_before_and_after():
    code = textwrap.dedent("""
        import os, threading
        from chimera.util.cores import pin_process
        cpu = min(os.sched_getaffinity(0))
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        pin_process(frozenset({cpu}))
        after = threading.Thread(target=stop.wait); after.start()
        masks = {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
        stop.set()
        print(len(masks), all(m == {cpu} for m in masks.values()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["3", "True"]


class _CoreCheck(nn.Module):
    """A layer that fails its forward in a worker unless the worker runs on ``cpus`` exactly (the driver, checking
    the chain on its example, is ``driver``)."""

    def __init__(self, cpus: set[int], driver: int) -> None:
        super().__init__()
        self.cpus, self.driver = cpus, driver
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        got = os.sched_getaffinity(0)
        if os.getpid() != self.driver and got != self.cpus:
            raise AssertionError(f"worker on cores {sorted(got)}, expected {sorted(self.cpus)}")
        return self.lin(x)


@pytest.mark.parametrize("affinity", ["auto", "off"])
def test_local_workers_run_on_the_cores_their_flag_gives(affinity):
    """Four 1F1B workers, stage s on worker s, each stage checking its worker's cores (on CI's two cores, auto pins
    workers 0 and 2 to one core and 1 and 3 to the other)."""
    cores = usable_cores()
    sets = core_sets(cores, 4, 1) if affinity == "auto" else None
    expected = [set(sets[s]) if sets else set(cores) for s in range(4)]

    def data(step, mb, rank):
        g = torch.Generator().manual_seed(step * 10 + mb)
        x = torch.randn(2, 4, generator=g)
        return x, x.sum(1, keepdim=True)

    driver = os.getpid()
    chain = chimera.LayerChain([lambda s=s: _CoreCheck(expected[s], driver) for s in range(4)],
                               lambda y, t: nn.functional.mse_loss(y.sum(1, keepdim=True), t), data(0, 0, 0),
                               name="cores")
    run = chimera.train(chain, data, schedule="1f1b", stages=4, micro_batches=2, steps=1, optimizer="sgd",
                        threads=1, cpu_affinity=affinity, partition="uniform")
    assert len(run.records) == 1

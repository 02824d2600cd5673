"""Generators against the definitions and formulas of docs/ARCHITECTURE.md, and against torch.distributed.pipelining."""

from fractions import Fraction

import pytest

from chimera.schedule import Costs, Kind, ScheduleConfigError, build_schedule, lower, simulate, validate
from chimera.schedule.ir import DOWN, UP, B, F

UNIT = Costs(fwd=1, bwd=1)


def texts(schedule, worker):
    return [a.text(schedule.bidirectional) for a in schedule.actions[worker]]


def test_chimera_d4_orders_match_design_example():
    s = build_schedule("chimera", 4, 4)
    assert list(s.actions[0]) == [F(DOWN, 0, 0), F(DOWN, 0, 1), F(UP, 3, 0), B(UP, 3, 0), F(UP, 3, 1), B(UP, 3, 1),
                                  B(DOWN, 0, 0), B(DOWN, 0, 1)]
    # worker 1: p = down (j = 1, a = 1, b = 1): F(p) | F(q) F(p) | F(q) B(q) | B(p) B(q) | B(p)
    assert texts(s, 1) == ["d1F0", "u2F0", "d1F1", "u2F1", "u2B0", "d1B0", "u2B1", "d1B1"]
    # the up pipe mirrors the down pipe
    assert texts(s, 3) == ["u0F0", "u0F1", "d3F0", "d3B0", "d3F1", "d3B1", "u0B0", "u0B1"]
    assert s.placement[(DOWN, 1)] == 1 and s.placement[(UP, 1)] == 2


@pytest.mark.parametrize("d", [2, 4, 6, 8, 12, 16])
@pytest.mark.parametrize("n_factor", [1, 2, 4])
def test_gpipe_and_1f1b_bubble_is_exact(d, n_factor):
    n = d * n_factor
    for name in ("gpipe", "1f1b"):
        r = simulate(build_schedule(name, d, n), UNIT)
        assert r.bubble == Fraction(d - 1, n + d - 1)
        assert isinstance(r.bubble, Fraction)


@pytest.mark.parametrize("d", [2, 4, 6, 8, 10, 16])
def test_chimera_unit_bubble_and_memory(d):
    s = build_schedule("chimera", d, d)
    r = simulate(s, UNIT)
    assert r.bubble == Fraction(d - 2, 2 * d + d - 2)
    assert all(d // 2 + 1 <= p <= d for p in r.peak_activations)
    assert max(r.peak_activations) == d


def test_unit_cost_makespans_f1_b2():
    c = Costs(fwd=1, bwd=2)
    assert simulate(build_schedule("1f1b", 4, 4), c).makespan == 21
    assert simulate(build_schedule("chimera", 4, 4), c).makespan == 16
    # lowering adds communication actions but no time at zero comm cost
    assert simulate(lower(build_schedule("chimera", 4, 4)), c).makespan == 16


@pytest.mark.parametrize("d,n", [(4, 4), (4, 8), (8, 16)])
def test_peak_activation_table(d, n):
    assert simulate(build_schedule("gpipe", d, n), UNIT).peak_activations == [n] * d
    assert simulate(build_schedule("1f1b", d, n), UNIT).peak_activations == [min(d - s, n) for s in range(d)]


def test_chimera_modes_for_more_microbatches():
    c = Costs(fwd=1, bwd=2)
    direct = simulate(build_schedule("chimera", 4, 8), c)
    doubling = simulate(build_schedule("chimera", 4, 8, mode="doubling"), c)
    halving = build_schedule("chimera", 4, 8, mode="halving")
    assert halving.microbatches == 16 and halving.microbatch_scale == Fraction(1, 2)
    assert simulate(halving, c).peak_activations == [3, 4, 4, 3]  # in full micro-batches: as the basic unit
    assert doubling.peak_activations == [6, 8, 8, 6]  # two micro-batches per forward slot
    assert doubling.makespan < direct.makespan  # fewer unit boundaries
    assert direct.peak_activations == [3, 4, 4, 3]  # direct concatenation keeps the unit's memory
    with pytest.raises(ScheduleConfigError, match="multiple of 2"):
        build_schedule("chimera", 4, 4, mode="doubling")


def test_chimera_direct_concatenation_interleaves_unit_boundary():
    s = build_schedule("chimera", 4, 8)
    # worker 0 (a = 2): the last phase of unit 0 interleaves with the first of unit 1
    assert texts(s, 0)[6:10] == ["d0B0", "d0F2", "d0B1", "d0F3"]


@pytest.mark.parametrize(
    "args,msg",
    [
        (("chimera", 3, 3), "even number"),
        (("chimera", 4, 6), "multiple of --stages"),
        (("gpipe", 4, 0), "micro-batches must be >= 1"),
        (("1f1b", 0, 4), "stages must be >= 1"),
        (("pipedream", 4, 4), "unknown schedule"),
        (("interleaved", 4, 6), "multiple of --stages"),
    ],
)
def test_bad_parameters_are_refused(args, msg):
    with pytest.raises(ScheduleConfigError, match=msg):
        build_schedule(*args)
    with pytest.raises(ScheduleConfigError, match="chunks"):
        build_schedule("interleaved", 4, 8, chunks=0)


def test_data_parallel_replicates_placement():
    s = build_schedule("chimera", 4, 4, data_parallel=2)
    assert s.stage_group(0) == [0, 3, 4, 7]
    assert build_schedule("1f1b", 4, 4, data_parallel=3).stage_group(1) == [1, 5, 9]
    lowered = lower(build_schedule("1f1b", 4, 4, data_parallel=2))
    assert any(a.kind is Kind.ALLREDUCE_START for a in lowered.actions[0])
    assert not any(a.kind is Kind.ALLREDUCE_START for a in lower(build_schedule("1f1b", 4, 4)).actions[0])


# --- cross-check against torch.distributed.pipelining (its schedules build their order without GPUs) ---


def _torch_orders(name, d, n, v=None):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(name, d, n, num_stages_per_rank=v)
    out = []
    for row in ops:
        out.append([str(a) for a in row if a is not None and str(a)[-1].isdigit()])
    return out


@pytest.mark.parametrize("d,n", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_gpipe_order_equals_torch(d, n):
    assert _torch_orders("GPipe", d, n) == [texts(build_schedule("gpipe", d, n), w) for w in range(d)]


@pytest.mark.parametrize("d,n", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_1f1b_order_equals_torch(d, n):
    ours = [texts(build_schedule("1f1b", d, n), w) for w in range(d)]
    theirs = _torch_orders("1F1B", d, n)
    assert theirs[:-1] == ours[:-1]
    # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1 (F1..FN: it
    # increments before the first steady-state forward); its runtime executes F0..F(N-1). Accept either
    # the exact order or exactly that off-by-one, so a fix in torch keeps this test green.
    shifted = [t if "B" in t else t.split("F")[0] + "F" + str(int(t.split("F")[1]) - 1) for t in theirs[-1]]
    assert ours[-1] in (theirs[-1], shifted)


@pytest.mark.parametrize("d,n,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 2)])
def test_interleaved_order_equals_torch(d, n, v):
    theirs = _torch_orders("Interleaved1F1B", d, n, v)
    ours = [texts(build_schedule("interleaved", d, n, chunks=v), w) for w in range(d)]
    assert ours == theirs


def test_all_generated_schedules_validate_lowered():
    for name, d, n in [("gpipe", 4, 8), ("1f1b", 8, 8), ("interleaved", 4, 8), ("chimera", 8, 16)]:
        s = build_schedule(name, d, n)
        validate(lower(s))

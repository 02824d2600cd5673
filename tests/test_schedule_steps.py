"""Consecutive training steps in the simulator (chimera/schedule/steps.py) and the period in `schedule best`."""

import json
from fractions import Fraction

import pytest

from chimera.cli import main
from chimera.schedule import Costs, Schedule, ScheduleError, build_schedule, lower, simulate
from chimera.schedule.best import per_stage, rank
from chimera.schedule.ir import Kind
from chimera.schedule.registry import candidates
from chimera.schedule.simulate import Simulator
from chimera.schedule.steps import boundaries, deferred, period, repeat, simulate_steps, step_sizes

#: a hang fails a test here within this many seconds (pytest-timeout), not at CI's limit
pytestmark = pytest.mark.timeout(120)

EQUAL = Costs(fwd=1, bwd=1, wgrad=1)


def test_one_f_one_b_by_hand():
    """1F1B, D = 2, N = 2, F = 1, B = 2. Worker 0 runs F0 F1 B0 B1, worker 1 F0 B0 F1 B1.

    Step 1: w0 F0 [0,1], F1 [1,2]; w1 F0 [1,2], B0 [2,4], F1 [4,5], B1 [5,7]; w0 B0 [4,6], B1 [7,9]: makespan 9.
    Step 2, overlapped: w0 starts F0' when it is free, at 9 (its own stages are updated: it ran their last
    backward); w1, idle since 7, gets F0' at 10; the step is step 1 shifted by 9, ends at 18, the third at 27.
    Drained: every worker waits for the end of step 1 (9) as well: the same 9, 18, 27. The worker that ends
    a 1F1B step (stage 0's) starts the next, so overlapping gains nothing: period 9 = the makespan.
    """
    s = build_schedule("1f1b", 2, 2)
    assert s.text().splitlines()[1:] == ["0: 0F0 0F1 0B0 0B1", "1: 1F0 1B0 1F1 1B1"]
    costs = Costs(fwd=1, bwd=2)
    for overlap in (True, False):
        t = simulate_steps(s, costs, 3, overlap)
        assert t.ends == [9, 18, 27] and t.period == 9 and t.last == 9 and t.makespan == 9
        assert t.result.starts[0][4:8] == [9, 10, 13, 16] and t.result.starts[1][4:8] == [10, 11, 13, 14]
        assert t.result.makespan == 27


PARALLELOGRAM = """# zb-h2 stages=2 microbatches=3
0: 0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2
1: 1F0 1I0 1F1 1I1 1F2 1I2 1W0 1W1 1W2"""


def test_overlap_shortens_a_parallelogram_by_hand():
    """ZB-H2's order at D = 2, N = 3, F = I = W = 1: worker 0 computes without a gap over [0, 9] (F0 F1 F2 [0,3];
    I0 waits for w1's I0 [2,3]: [3,4]; W0 [4,5]; I1 after w1's I1 [4,5]: [5,6]; W1; I2 after w1's I2 [6,7]: [7,8];
    W2 [8,9]), worker 1 over [1, 10] (F0 [1,2] I0 F1 I1 F2 I2 then W0 W1 W2 [7,10]): makespan 10.
    Overlapped: worker 0 starts step 2 at 9, worker 1 is free at 10 when its F0' arrives: every step is step 1
    shifted by 9 = 3N, ends 10, 19, 28. Drained: step 2 waits for worker 1's end, 10: ends 10, 20, 30."""
    s = Schedule.from_text(PARALLELOGRAM)
    assert simulate(s, EQUAL).makespan == 10
    over, drained = simulate_steps(s, EQUAL, 3, True), simulate_steps(s, EQUAL, 3, False)
    assert over.ends == [10, 19, 28] and over.period == 9 == 3 * 3
    assert drained.ends == [10, 20, 30] and drained.period == 10
    assert over.result.starts[0][9] == 9 and drained.result.starts[0][9] == 10  # worker 0's F0 of step 2


LOPSIDED = """# lopsided stages=2 microbatches=3
0: d0F0 d0F1 u1F0 d0I0 d0W0 d0I1 d0W1 u1I0 u1W0
1: u0F0 d1F0 d1I0 d1W0 d1F1 d1I1 d1W1 u0I0 u0W0"""


def test_overlapped_stage_waits_for_its_other_replica_by_hand():
    """Two pipes on two workers (stage 0: down on w0, up on w1), F = I = W = 1. Step 1: w0 d0F0 d0F1 u1F0 [0,3],
    d0I0 after w1's d1I0 [2,3]: [3,4], d0W0 [4,5], d0I1 after w1's d1I1 [5,6]: [6,7], d0W1 [7,8], u1I0 [8,9],
    u1W0 [9,10]; w1 ends u0I0 (after u1I0) [9,10], u0W0 [10,11]. Step 2's d0F0 on w0 could start at 10 (w0 is
    free), but stage 0's update needs the weight gradients of both replicas: u0W0 ends at 11, so it starts at 11."""
    s = Schedule.from_text(LOPSIDED)
    t = simulate_steps(s, EQUAL, 2, True)
    assert t.ends[0] == 11 and t.result.ends[0][8] == 10 and t.result.ends[1][8] == 11
    assert t.result.starts[0][9] == 11
    assert Simulator(repeat(s, 2)).run(EQUAL).starts[0][9] == 10  # without the step boundary's edges


def _candidates(d: int, n: int):
    for label, spec, options in candidates(d, n):
        chunks = spec.chunks_of(options)
        split = per_stage(EQUAL, chunks).first_stage_whole_backward(d * chunks)
        yield label, build_schedule(spec.name, d, n, **options, order_costs=split), chunks, split


@pytest.mark.parametrize("d,n", [(4, 8), (8, 8)])
def test_drained_period_is_one_step_and_overlap_never_slower(d, n):
    """Every candidate, compute-only (F = I = W) and lowered with two data-parallel groups (messages, gradient sums
    and the optimizer step costed): drained, the period is one step's makespan (the optimizer step included);
    overlapped, never longer, and never under the 3N units a worker computes per step. The first step of k is
    the one-step simulation."""
    gains = set()
    for label, s, chunks, split in _candidates(d, n):
        lowered = lower(s.with_data_parallel(2))
        costly = per_stage(Costs(fwd=1, bwd=1, wgrad=1, allreduce=3, optimizer=2, p2p_latency=1), chunks)
        for sched, costs in ((s, split), (lowered, costly.first_stage_whole_backward(d * chunks))):
            one = simulate(sched, costs).makespan
            drained, over = period(sched, costs, 4, overlap=False), period(sched, costs, 4, overlap=True)
            assert drained.period == drained.last == one and drained.makespan == over.makespan == one, label
            assert 3 * n <= over.period <= one, label
            if over.period < one:
                gains.add((label, sched.lowered))
    if n >= 2 * d:  # parallelograms: the start-up under the drain (at N = D none has the micro-batches to fill it)
        assert ("zb-h2", False) in gains and ("bitpipe", False) in gains


def test_lowered_overlap_gains_with_the_optimizer_step():
    """ZB-H2 lowered, D = 4, N = 8, an optimizer step of 2: one step 29, overlapped period 3N + 2 = 26 (each
    worker's optimizer step on its own path), drained 29."""
    c = EQUAL.first_stage_whole_backward(4)
    s = lower(build_schedule("zb-h2", 4, 8, order_costs=c))
    costs = Costs(fwd=1, bwd=1, wgrad=1, optimizer=2).first_stage_whole_backward(4)
    assert simulate(s, costs).makespan == 29
    assert period(s, costs, 5, True).period == 26 and period(s, costs, 5, False).period == 29


@pytest.mark.parametrize("d", [2, 4, 8, 16])
def test_best_period_within_3n_plus_1(d):
    """F = I = W: the best candidate by period over 5 overlapped steps is within 3N + 1, N in {D, 2D, 4D}, never
    under 3N. At N = D = 16 only Chimera-halving's steps ordered jointly (+joint steps) and the registered list
    that order repeats (chimera-relisted, built only when named) get there: the searched schedules' fixed lists
    (best: four-pipe Chimera, 3N + D/4 - 1) miss it (51 > 49)."""
    for n in (d, 2 * d, 4 * d):
        ranked = rank(d, n, EQUAL, steps=5, by="period")
        assert all(3 * n <= c.period for c in ranked)
        assert all(c.period <= c.makespan for c in ranked if not c.deferred)
        assert ranked[0].period == min(c.period for c in ranked)
        assert ranked[0].period <= 3 * n + 1, (d, n, ranked[0])
        if d == 16 and n == 16:
            searched = min(c.period for c in ranked if not c.deferred and c.name != "chimera-relisted")
            assert searched == 3 * n + d // 4 - 1 and ranked[0].period == 3 * n
            # the relisted order reaches 3N as a fixed list, so no joint order is tried past it
            assert [c.label for c in ranked if c.period == 3 * n] == ["chimera-relisted"]
            assert (ranked[0].peak, ranked[0].shares) == (16, 2)  # 1F1B's activations (the searched lists': 8)


def _halving(d: int, n: int):
    s = build_schedule("chimera", d, n, mode="halving", split_backward=True,
                       order_costs=EQUAL.first_stage_whole_backward(d))
    return s, EQUAL.first_stage_whole_backward(d)


@pytest.mark.parametrize("d", [8, 16])
def test_joint_steps_reach_3n_at_n_equal_d(d):
    """Chimera with backward halving, split backward, N = D: its fixed lists repeat at one step's makespan
    (3N + D/4 - 1/2: 25.5 at D = 8, 51.5 at D = 16); its steps ordered jointly (each stage's next-step forwards
    waiting only for that stage's W) run at exactly 3N from the second step on, every step as long."""
    s, costs = _halving(d, d)
    fixed, over = period(s, costs, 5), period(s, costs, 5, defer_w=True)
    assert fixed.period == fixed.makespan == {8: Fraction(51, 2), 16: Fraction(103, 2)}[d]
    assert over.period == over.last == 3 * d
    assert [b - a for a, b in zip(over.ends, over.ends[1:])] == [3 * d] * 4


def test_joint_order_keeps_the_boundary():
    """D = N = 8, steps ordered jointly: the same actions as the steps repeated, reordered; the timeline keeps the
    overlapped boundary, checked from the times alone (every compute of a stage in step j+1 starts after every W
    of that stage in step j, on all its replicas, has ended). No W crosses the boundary here (each stage's W are
    the oldest pending when its next-step forward could start): the joint order is its first step's order
    repeated, and that order is what reaches 3N (Chimera's own list repeats at 25.5)."""
    s, costs = _halving(8, 8)
    t = simulate_steps(s, costs, 4, defer_w=True)
    many, size = t.result.schedule, step_sizes(s)
    assert sorted(map(str, (a for r in many.actions for a in r))) == sorted(
        map(str, (a for r in repeat(s, 4).actions for a in r)))
    assert many.actions != repeat(s, 4).actions and many.actions == repeat(deferred(s, 1, costs), 4).actions
    assert period(deferred(s, 1, costs), costs, 4).period == 24
    w_end: dict[tuple[int, int], object] = {}  # (stage, step) -> its last W's end, any replica
    first: dict[tuple[int, int], object] = {}  # (stage, step) -> its first compute's start, any replica
    for w, row in enumerate(many.actions):
        for a, start, end in zip(row, t.result.starts[w], t.result.ends[w]):
            j = a.microbatch // size[a.pipe]
            if a.kind is Kind.W:
                w_end[(a.stage, j)] = max(w_end.get((a.stage, j), end), end)
            first[(a.stage, j)] = min(first.get((a.stage, j), start), start)
    assert len(first) == 4 * s.stages
    assert all(first[(st, j)] >= w_end[(st, j - 1)] for st, j in first if j)
    assert any(first[(st, j)] < max(w_end[(u, j - 1)] for u in range(s.stages)) for st, j in first if j)


def test_joint_order_by_hand():
    """LOPSIDED's two steps ordered jointly (F = I = W = 1): each worker runs its oldest W where it would wait; the
    boundary's edges: each (worker, pipe, stage)'s first compute of step 2 waits for the last step-1 W of that
    stage on both workers (stage 0: w0's d0W1, w1's u0W0; stage 1: w0's u1W0, w1's d1W1). Every step takes 9."""
    s = Schedule.from_text(LOPSIDED)
    t = simulate_steps(s, EQUAL, 2, defer_w=True)
    assert t.result.schedule.text().splitlines()[1:] == [
        "0: d0F0 d0F1 u1F0 d0I0 u1I0 d0I1 d0W0 u1W0 d0W1 d0F2 d0F3 u1F1 d0I2 u1I1 d0I3 d0W2 u1W1 d0W3",
        "1: u0F0 d1F0 d1I0 d1F1 d1I1 u0I0 d1W0 d1W1 u0W0 u0F1 d1F2 d1I2 d1F3 d1I3 u0I1 d1W2 d1W3 u0W1"]
    assert t.ends == [9, 18] and t.period == 9
    gates = boundaries(s, 2, True, t.result.schedule)
    assert {k: set(v) for k, v in gates.items()} == {9: {8, 26}, 11: {7, 25}, 27: {8, 26}, 28: {7, 25}}


def test_deferred_needs_split_backward_and_the_overlapped_boundary():
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="needs a compute-only schedule with split backward"):
        deferred(s, 3)
    with pytest.raises(ValueError, match="needs the overlapped step boundary"):
        simulate_steps(build_schedule("zb-h1", 2, 2), EQUAL, 3, overlap=False, defer_w=True)


def test_default_ranking_unchanged_and_period_column():
    plain, timed = rank(8, 16, EQUAL), rank(8, 16, EQUAL, steps=3)
    assert [c.label for c in plain] == [c.label for c in timed] and all(c.period is None for c in plain)
    by_period = rank(8, 16, EQUAL, steps=3, by="period")
    assert [c.period for c in by_period] == sorted(c.period for c in by_period)
    with pytest.raises(ValueError, match="needs steps >= 2"):
        rank(8, 16, EQUAL, by="period")
    with pytest.raises(ValueError, match="rank by one of"):
        rank(8, 16, EQUAL, steps=3, by="speed")


def test_cli_best_period(capsys):
    assert main(["schedule", "best", "-D", "4", "-N", "8", "--fwd", "1", "--bwd", "1", "--wgrad", "1",
                 "--rank-by", "period", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["by"] == "period" and out["candidates"][0]["period"] == 24 == min(
        c["period"] for c in out["candidates"])
    zb = next(c for c in out["candidates"] if c["schedule"] == "zb-h2")
    assert zb["makespan"] == 27 and zb["period"] == 24
    assert main(["schedule", "best", "-D", "4", "-N", "8", "--steps", "1"]) == 0
    assert "period" not in capsys.readouterr().out.splitlines()[0]
    assert main(["schedule", "best", "-D", "4", "-N", "8"]) == 0
    assert capsys.readouterr().out.split()[:3] == ["schedule", "makespan", "period"]
    assert main(["schedule", "best", "-D", "4", "-N", "8", "--steps", "1", "--rank-by", "period"]) != 0
    assert "--rank-by period needs --steps >= 2" in capsys.readouterr().err


def test_bad_steps_and_a_deadlocked_boundary():
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        repeat(s, 0)
    with pytest.raises(ValueError, match="a period needs steps >= 2"):
        period(s, EQUAL, 1)
    assert repeat(s, 2).text().splitlines()[1] == "0: 0F0 0F1 0B0 0B1 0F2 0F3 0B2 0B3"
    with pytest.raises(ScheduleError, match=r"d0F0 waits for d1B1 \(worker 1, action 3\) to run first"):
        Simulator(s, {0: (7,)}).run(EQUAL)  # worker 0's first action after worker 1's last, which needs it


def test_chimera_relisted_repeats_at_3n_and_is_built_only_when_named():
    """The registered relisted Chimera (what the joint order found) runs its steps every 3N units at N = D, where
    Chimera's own halving order needs 3N + D/4 - 1/2, with Chimera's two shares; auto and the planner skip it."""
    from chimera.schedule.registry import get

    own = build_schedule("chimera", 8, 8, mode="halving", split_backward=True, order_costs=EQUAL)
    relisted = build_schedule("chimera-relisted", 8, 8, order_costs=EQUAL)
    assert relisted.placement == own.placement and relisted.microbatch_scale == own.microbatch_scale
    assert sorted(map(str, (a for row in relisted.actions for a in row))) == sorted(
        map(str, (a for row in own.actions for a in row)))  # the same actions, another order
    assert simulate_steps(own, EQUAL, 5, True).period == Fraction(51, 2)
    t = simulate_steps(relisted, EQUAL, 5, True)
    assert t.period == 24 and t.last == 24
    assert get("chimera-relisted").shares == 2
    assert all(label.split()[0] != "chimera-relisted" for label, _, _ in candidates(8, 8, auto_only=False))


def test_tied_stages_hold_the_boundary_like_replicas():
    """A model whose first and last layers share a weight (an embedding tied to the output layer) sums the two
    stages' gradients before either updates, so stage 0's next-step compute also waits for the last stage's last W
    of the step before. ZB-H2 (D = 4, N = 8, F = I = W), whose last stage drains its W after stage 0 could start
    the next step, loses its overlap (period 24 -> 27, its makespan; measured on the delay model in
    bench/RESULTS.md); ZB-V, whose V puts both ends on worker 0, keeps it (48)."""
    h2 = build_schedule("zb-h2", 4, 8)
    gates = boundaries(h2, 2, True, tied=((0, 3),))
    rows, base = repeat(h2, 2).actions, [0]
    for row in rows:
        base.append(base[-1] + len(row))
    last_w3 = max(base[3] + i for i, a in enumerate(rows[3][:len(rows[3]) // 2]) if a.kind is Kind.W)
    first_f0 = base[0] + len(rows[0]) // 2  # worker 0's first action of step 2: a forward of stage 0
    assert rows[0][len(rows[0]) // 2].kind is Kind.F and last_w3 in gates[first_f0]
    assert last_w3 not in boundaries(h2, 2, True).get(first_f0, ())
    assert (period(h2, EQUAL).period, period(h2, EQUAL, tied=((0, 3),)).period) == (24, 27)
    assert period(h2, EQUAL, tied=((0, 3),)).period == period(h2, EQUAL, overlap=False).period
    v = build_schedule("zb-v", 4, 8)
    assert period(v, EQUAL).period == period(v, EQUAL, tied=((0, 7),)).period == 48
    # schedule best's ranking (costs per D-stage share: a V's half stages cost half)
    tied = {c.label: c.period for c in rank(4, 8, EQUAL, steps=5, by="period", joint=False,
                                            tied=lambda parts: [(0, parts - 1)])}
    free = {c.label: c.period for c in rank(4, 8, EQUAL, steps=5, by="period", joint=False)}
    assert (free["zb-h2"], tied["zb-h2"]) == (24, 27) and free["zb-v"] == tied["zb-v"] == 24, (free, tied)

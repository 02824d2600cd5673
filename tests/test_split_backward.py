"""Split backward in the IR: I (input gradient) and W (weight gradient) replace a full B, rows of the kinds table."""

from fractions import Fraction

import pytest

from chimera.schedule import (
    Action,
    Costs,
    Kind,
    ScheduleConfigError,
    ScheduleError,
    build_schedule,
    lower,
    simulate,
    validate,
)
from chimera.schedule.fill import EQUAL
from chimera.schedule.ir import DOWN, from_rows
from chimera.schedule.kinds import PARTS
from chimera.schedule.lowering import split_backward


def _split(name: str = "1f1b", d: int = 2, n: int = 2):
    return split_backward(build_schedule(name, d, n))


def test_b_has_the_parts_i_then_w_and_costs_their_sum():
    assert PARTS == {Kind.B: (Kind.I, Kind.W)}
    assert Action.parse("u2I1") == Action(Kind.I, "up", 2, 1) and Action.parse("3W0").kind is Kind.W
    c = Costs(fwd=1, bwd=[2, 3], wgrad=5)
    assert c.of(Action(Kind.B, DOWN, 1, 0)) == 8 and c.of(Action(Kind.I, DOWN, 1, 0)) == 3
    assert c.of(Action(Kind.W, DOWN, 0, 0, count=2)) == 10
    assert Costs(bwd=2).of(Action(Kind.B, DOWN, 0, 0)) == 2  # wgrad defaults to 0: bwd is the whole backward


def test_split_in_place_is_valid_and_does_the_same_work():
    for name in ("1f1b", "gpipe", "chimera", "interleaved"):
        whole, split = build_schedule(name, 4, 8), split_backward(build_schedule(name, 4, 8))
        validate(split)
        costs = Costs(fwd=1, bwd=1, wgrad=1)
        a, b = simulate(whole, costs), simulate(split, costs)
        assert a.busy == b.busy and b.makespan <= a.makespan  # the gradient leaves before W runs
        assert a.peak_activations == b.peak_activations


@pytest.mark.parametrize("edit,msg", [
    (lambda r: r[1].remove(Action(Kind.W, DOWN, 1, 1)), r"1B1 \(B of micro-batch 1\) appears 0 times and its parts "
                                                       r"I 1 times, W 0 times: expected on worker 1 either one B or "
                                                       r"one I and one W"),
    (lambda r: r[1].append(Action(Kind.B, DOWN, 1, 1)), r"1B1 \(B of micro-batch 1\) appears 1 times and its parts "
                                                       r"I 1 times, W 1 times"),
    (lambda r: r[0].insert(0, r[0].pop(r[0].index(Action(Kind.W, DOWN, 0, 0)))), r"0W0 comes before its input-gradient"),
])
def test_validator_rules_for_the_parts(edit, msg):
    rows = [list(r) for r in _split().actions]
    edit(rows)
    with pytest.raises(ScheduleError, match=msg):
        validate(from_rows(rows, microbatches=2))


def test_deferred_w_holds_activations_and_delays_the_allreduce():
    s = _split("1f1b", 2, 2)
    rows = [list(r) for r in s.actions]
    w0 = rows[0].pop(rows[0].index(Action(Kind.W, DOWN, 0, 0)))
    rows[0].append(w0)  # W of micro-batch 0 after everything else on worker 0
    late = from_rows(rows, microbatches=2)
    validate(late)
    assert simulate(s).peak_activations == [2, 1]
    assert simulate(late).peak_activations == [2, 1]  # it was held anyway; now drop one at the end
    rows[0] = [a for a in rows[0] if a.kind is Kind.F] + [a for a in rows[0] if a.kind is not Kind.F]
    both = from_rows(rows, microbatches=2)
    assert simulate(both).peak_activations == [2, 1]
    lowered = lower(split_backward(build_schedule("1f1b", 2, 2)).with_data_parallel(2))
    row = [a.text(False) for a in lowered.actions[0]]
    assert row.index("0AR_START") > row.index("0W1") > row.index("0I1")  # the allreduce starts after the last W


def test_peak_counts_what_w_keeps():
    rows = [[Action(Kind.F, DOWN, 0, 0), Action(Kind.I, DOWN, 0, 0), Action(Kind.F, DOWN, 0, 1),
             Action(Kind.I, DOWN, 0, 1), Action(Kind.W, DOWN, 0, 0), Action(Kind.W, DOWN, 0, 1)]]
    s = from_rows(rows, microbatches=2)
    validate(s)
    assert simulate(s).peak_activations == [2]  # micro-batch 0 is still held for its W when micro-batch 1 runs


def _sim(name: str, d: int, n: int, **kw):
    s = build_schedule(name, d, n, **kw)
    validate(s)
    return simulate(s, Costs(fwd=1, bwd=1, wgrad=1))


@pytest.mark.parametrize("d,k", [(2, 1), (4, 1), (4, 2), (8, 2), (8, 4)])
def test_zero_bubble_schedules_beat_1f1b_within_their_memory(d, k):
    n = d * k
    base, split = _sim("1f1b", d, n), _sim("1f1b", d, n, split_backward=True)
    h1, h2 = _sim("zb-h1", d, n), _sim("zb-h2", d, n)
    assert max(h1.peak_activations) == max(base.peak_activations)  # ZB-H1: 1F1B's peak
    assert max(h2.peak_activations) <= min(n, 2 * d - 1)
    assert h1.makespan <= split.makespan < base.makespan and h2.makespan <= h1.makespan
    if d >= 4:
        assert h1.makespan < split.makespan


def test_chimera_split_reaches_its_start_up_bound():
    """D = 8, N = 16, F = B = W: worker 3 waits 3 forwards, then works 3N units: makespan >= 51 (bubble 0.0588), which
    the split schedule reaches (the W actions fill every other wait) at Chimera's activation memory; backward halving
    runs every action on half a micro-batch and halves the wait."""
    direct, plain = _sim("chimera", 8, 16, split_backward=True), _sim("chimera", 8, 16)
    assert direct.makespan == 51 and max(direct.peak_activations) == max(plain.peak_activations)
    halving = _sim("chimera", 8, 16, split_backward=True, mode="halving")
    assert halving.makespan == 49.5 and halving.bubble <= 0.031 and max(halving.peak_activations) == 4
    for d, n in [(2, 2), (4, 4), (4, 8), (8, 8)]:
        split = _sim("chimera", d, n, split_backward=True)
        assert split.makespan == d // 2 - 1 + 3 * n  # the bound, met
    assert _sim("chimera", 8, 32, split_backward=True, mode="doubling").makespan < _sim(
        "chimera", 8, 32, mode="doubling").makespan


def test_bitpipe_two_v_shaped_pipes():
    s = build_schedule("bitpipe", 4, 8)
    assert s.stages == 8 and all(len(s.stages_of(w)) == 4 for w in range(4))
    assert s.placement[("down", 0)] == s.placement[("down", 7)] == 0 and s.placement[("up", 0)] == 3
    for d, n in [(2, 2), (2, 4), (4, 4), (4, 8), (8, 16)]:
        validate(build_schedule("bitpipe", d, n))
    half = Costs(fwd=Fraction(1, 2), bwd=Fraction(1, 2), wgrad=Fraction(1, 2))  # 2D stages, each half a share
    r = simulate(build_schedule("bitpipe", 8, 16), half)
    assert r.makespan == Fraction(99, 2) and r.bubble < 0.031 and max(r.peak_activations) <= 3 * 8
    with pytest.raises(ScheduleConfigError, match="must be even"):
        build_schedule("bitpipe", 4, 5)


def test_chimera4_four_pipes_start_on_four_workers():
    s = build_schedule("chimera4", 8, 16)
    assert s.pipes == ("down", "up", "down2", "up2") and s.pipe_microbatches("up2") == 4
    assert [s.placement[(p, 0)] for p in s.pipes] == [0, 7, 4, 3]  # the four first stages, D/2 apart
    assert all(sorted(st for _, st in s.stages_of(w)) == sorted({w, 7 - w, (w - 4) % 8, (3 - w) % 8})
               for w in range(8))  # four distinct stages per worker
    assert all(s.stage_group_size(st) == 4 for st in range(8)) and s.global_microbatch("up2", 1) == 13
    for d, n in [(4, 4), (4, 8), (8, 8), (8, 32), (16, 16)]:
        validate(lower(build_schedule("chimera4", d, n, data_parallel=2)))
    for d, n in [(4, 4), (4, 16), (8, 8), (8, 16)]:  # 3N units of work + the wait of the worker that starts last
        costs = EQUAL.first_stage_whole_backward(d)
        r = simulate(build_schedule("chimera4", d, n, order_costs=costs), costs)
        assert r.makespan == 3 * n + d // 4 - 1 and max(r.peak_activations) <= d, (d, n)
    text = " ".join(a.text(s.bidirectional) for a in s.actions[4])
    assert "D0F0" in text and [Action.parse(t) for t in text.split()] == list(s.actions[4])
    for d, n in [(6, 6), (4, 6), (2, 4)]:
        with pytest.raises(ScheduleConfigError, match="multiples of 4"):
            build_schedule("chimera4", d, n)


def test_zb_v_one_v_at_1f1b_memory_meets_its_bound():
    """ZB-V: 2D half stages in one V (worker w holds stages w and 2D-1-w), a flushed step of 3N + (D-1)/2 units at
    F = I = W, and never more activations than 1F1B's peak (D micro-batches: 2D half-stage ones)."""
    s = build_schedule("zb-v", 4, 8)
    assert s.stages == 8 and s.pipes == ("down",)
    assert all(sorted(st for _, st in s.stages_of(w)) == [w, 7 - w] for w in range(4))
    half = Costs(fwd=Fraction(1, 2), bwd=Fraction(1, 2), wgrad=Fraction(1, 2))
    for d, n in [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16), (8, 32), (16, 32)]:
        s = build_schedule("zb-v", d, n)
        validate(s)
        validate(lower(s))  # stage s's activation and stage 2D-1-s's gradient share a channel: taken in order
        r = simulate(s, half)
        assert r.makespan == 3 * n + Fraction(d - 1, 2), (d, n, r.makespan)
        assert max(r.peak_activations) <= 2 * min(d, n), (d, n, r.peak_activations)


def test_zb_v_is_the_fastest_at_1f1b_memory():
    """At one share of weights plus 1F1B's activations (D = 8, N = 16), ZB-V (51.5 units) is picked over ZB-H1 (57),
    and everything faster needs more memory."""
    from chimera.schedule.best import best

    choice, ranked = best(8, 16, EQUAL, memory_limit=24, weight_memory=16)
    assert (choice.label, choice.makespan, choice.shares) == ("zb-v", Fraction(103, 2), 1)
    assert all(not c.fits for c in ranked if c.makespan < choice.makespan)


def test_a_named_list_ordered_schedule_is_ordered_as_the_runtime_runs_it():
    """``--schedule zb-v`` gets the order ``auto`` would run: made with the first stage's true split (its I empty,
    its W the whole backward), which at D = N = 4 reaches 13.5 units, where the order made with F = I = W on
    every stage runs 15."""
    from chimera.compile import compile_job
    from chimera.config import TrainConfig
    from chimera.schedule.best import per_stage

    cfg = TrainConfig.from_flags(model="bert-tiny", model_overrides={"num_hidden_layers": 6}, corpus="synthetic",
                                 seq_len=16, schedule="zb-v", stages=4, micro_batches=4, steps=1)
    true = per_stage(EQUAL, 2).first_stage_whole_backward(8)
    assert simulate(compile_job(cfg).schedule.compute_only(), true).makespan == Fraction(27, 2)
    assert simulate(build_schedule("zb-v", 4, 4), true).makespan == 15

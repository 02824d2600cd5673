"""Split backward in the IR: I (input gradient) and W (weight gradient) replace a full B, rows of the kinds table."""

import pytest

from chimera.schedule import Action, Costs, Kind, ScheduleError, build_schedule, lower, simulate, validate
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

"""The validator accepts every generated schedule and rejects broken ones, printing the grid."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chimera.schedule import ScheduleError, build_schedule, lower, simulate, validate
from chimera.schedule.ir import DOWN, UP, Action, B, F, Kind, Schedule, from_rows


@st.composite
def schedules(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "chimera"]))
    d = draw(st.integers(1, 16))
    if name == "chimera":
        d = max(2, d - d % 2)
    if name in ("chimera", "interleaved"):
        n = d * draw(st.integers(1, 4))
    else:
        n = draw(st.integers(1, 4 * d))
    kw = {}
    if name == "interleaved":
        kw["chunks"] = draw(st.integers(1, 3))
    if name == "chimera":
        modes = ["direct", "halving"] + (["doubling"] if (n // d) % 2 == 0 else [])
        kw["mode"] = draw(st.sampled_from(modes))
    w = draw(st.integers(1, 3))
    return build_schedule(name, d, n, data_parallel=w, **kw)


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_every_generated_schedule_validates(s):
    validate(s)
    lowered = lower(s)
    validate(lowered)
    r = simulate(lowered)
    assert r.makespan == simulate(s).makespan  # zero comm cost: lowering adds no time
    assert 0 <= r.bubble < 1


def _gpipe2():
    return build_schedule("gpipe", 2, 2)


def test_rejects_missing_backward():
    s = _gpipe2()
    rows = [list(r) for r in s.actions]
    rows[1].remove(B(DOWN, 1, 1))
    with pytest.raises(ScheduleError, match=r"1B1 \(B of micro-batch 1\) appears 0 times"):
        validate(from_rows(rows, microbatches=2))


def test_rejects_forward_after_backward():
    rows = [[F(DOWN, 0, 0), F(DOWN, 0, 1), B(DOWN, 0, 0), B(DOWN, 0, 1)],
            [F(DOWN, 1, 0), B(DOWN, 1, 0), B(DOWN, 1, 1), F(DOWN, 1, 1)]]
    with pytest.raises(ScheduleError, match="comes before its forward") as e:
        validate(from_rows(rows))
    assert ">1B1<" in str(e.value)  # the grid marks the offending action


def test_rejects_duplicate_and_misplaced_actions():
    rows = [[F(DOWN, 0, 0), F(DOWN, 0, 0), B(DOWN, 0, 0)], [F(DOWN, 1, 0), B(DOWN, 1, 0)]]
    with pytest.raises(ScheduleError, match="appears 2 times"):
        validate(from_rows(rows, microbatches=1))
    s = _gpipe2()
    bad = Schedule(s.stages, s.microbatches, s.placement, (s.actions[1], s.actions[0]))
    with pytest.raises(ScheduleError, match="is on worker 0 but stage 1"):
        validate(bad)


def test_rejects_swapped_send_order():
    # worker 0 sends micro-batch 0 then 1, worker 1 receives 1 first: NCCL would pair them wrongly / hang
    s = lower(_gpipe2())
    rows = [list(r) for r in s.actions]
    r1 = rows[1]
    i0, i1 = r1.index(Action(Kind.RECV_ACT, DOWN, 1, 0)), r1.index(Action(Kind.RECV_ACT, DOWN, 1, 1))
    f0, f1 = r1.index(F(DOWN, 1, 0)), r1.index(F(DOWN, 1, 1))
    r1[i0], r1[i1] = r1[i1], r1[i0]
    r1[f0], r1[f1] = r1[f1], r1[f0]
    with pytest.raises(ScheduleError, match="messages match in order") as e:
        validate(from_rows(rows, microbatches=2))
    assert "step " in str(e.value) and "w0" in str(e.value)


def test_rejects_deadlock_with_grid():
    # both Chimera workers of D=2 start with the pipe that needs the other's output first
    rows = [[F(UP, 1, 0), B(UP, 1, 0), F(DOWN, 0, 0), B(DOWN, 0, 0)],
            [F(DOWN, 1, 0), B(DOWN, 1, 0), F(UP, 0, 0), B(UP, 0, 0)]]
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate(from_rows(rows, microbatches=2))
    msg = str(e.value)
    assert ">u1RECV_F0<" in msg and ">d1RECV_F0<" in msg
    assert "waits for worker" in msg


def test_rejects_allreduce_wait_before_peer_starts():
    s = lower(build_schedule("chimera", 2, 2))
    rows = [list(r) for r in s.actions]
    # worker 0 waits for stage 0's allreduce before it has run the backward that worker 1 needs
    wait = Action(Kind.ALLREDUCE_WAIT, UP, 1)
    rows[0].remove(wait)
    rows[0].insert(0, wait)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(from_rows(rows, microbatches=2))

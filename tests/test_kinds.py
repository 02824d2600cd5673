"""The table of action kinds: one row per kind, and every pass (lowering, replay, simulator, executor) reads it."""

import pytest

from chimera.runtime.executor import Executor, segments
from chimera.schedule import Action, Costs, Kind, build_schedule, lower
from chimera.schedule.kinds import KIND_OF_CODE, SPECS, TRANSFER, Msg, Res, Role, message, neighbour


def test_every_kind_has_one_row_and_a_unique_code():
    assert set(KIND_OF_CODE.values()) == set(SPECS)
    assert all(kind.value == spec.code and Kind(spec.code) is kind for kind, spec in SPECS.items())
    assert TRANSFER == {Res.ACT: (Kind.SEND_ACT, Kind.RECV_ACT), Res.GRAD: (Kind.SEND_GRAD, Kind.RECV_GRAD)}
    for kind, spec in SPECS.items():
        assert Action.parse(Action(kind, "up", 1, 2).text()).kind is kind
        if spec.role in (Role.SEND, Role.RECV):
            assert spec.carries is not None and spec.peer in (-1, 1)


def test_one_message_key_pairs_sends_with_receives():
    # SEND_ACT of stage 1 and RECV_ACT of stage 2 carry the same message; likewise SEND_GRAD(2) / RECV_GRAD(1)
    assert message(Kind.SEND_ACT, "down", 1, 3) == (Msg(Res.ACT, "down", 1, 3), 2)
    assert message(Kind.RECV_ACT, "down", 2, 3) == (Msg(Res.ACT, "down", 1, 3), 1)
    assert message(Kind.SEND_GRAD, "up", 2, 0)[0] == message(Kind.RECV_GRAD, "up", 1, 0)[0]
    assert neighbour(0, -1, 4) is None and neighbour(3, 1, 4) is None and neighbour(1, 1, 4) == 2
    with pytest.raises(ValueError, match="not a send/receive kind"):
        message(Kind.F, "down", 0, 0)


def test_lowering_follows_the_table():
    s = lower(build_schedule("1f1b", 3, 2))
    middle = [a.text(False) for a in s.actions[1]]
    # the receive of what F consumes before it, the send of what it produces after it
    assert middle[:3] == ["1RECV_F0", "1F0", "1SEND_F0"]
    assert "1RECV_B0" in middle and middle[middle.index("1RECV_B0") + 1] == "1B0"
    assert middle[middle.index("1B0") + 1] == "1SEND_B0"
    assert [a.kind for a in s.actions[0][-2:]] == [Kind.B, Kind.OPTIMIZER_STEP]  # stage 0 sends no gradient


def test_costs_come_from_the_kind_rows():
    c = Costs(fwd=[1, 5], bwd=2, p2p_latency=0.5, optimizer=3, allreduce=7)
    assert c.of(Action(Kind.F, "down", 1, 0, count=2)) == 10
    assert c.of(Action(Kind.B, "down", 0, 0), scale=0.5) == 1
    assert c.of(Action(Kind.SEND_ACT, "down", 0, 0)) == 0.5
    assert c.of(Action(Kind.OPTIMIZER_STEP)) == 3
    assert c.of(Action(Kind.ALLREDUCE_START, "down", 0)) == 7
    assert c.of(Action(Kind.ALLREDUCE_WAIT, "down", 0)) == 0


def test_executor_refuses_a_kind_without_handler():
    acts = lower(build_schedule("1f1b", 2, 2)).actions[0]
    with pytest.raises(RuntimeError, match="no handler for action kind\\(s\\) B, OPT;"):
        Executor(segments(acts), {Kind.F: lambda a, st: None}, batches=None, name="worker 0")  # type: ignore[arg-type]
    segs = segments(acts)
    assert [len(s) for s in segs if s[0].kind.is_p2p] and all(
        all(a.kind.is_p2p for a in s) for s in segs if s[0].kind.is_p2p)

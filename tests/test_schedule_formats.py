"""Text, CSV and JSON round-trip to the identical schedule."""

import json

import pytest

from chimera.schedule import build_schedule, from_csv, from_json, lower, to_csv, to_json
from chimera.schedule.ir import Action, Schedule

CASES = [("gpipe", 4, 8, {}), ("1f1b", 4, 6, {}), ("interleaved", 4, 8, {"chunks": 2}),
         ("chimera", 4, 8, {}), ("chimera", 4, 8, {"mode": "doubling"}), ("chimera", 4, 4, {"mode": "halving"}),
         ("chimera", 6, 6, {"data_parallel": 2})]


@pytest.mark.parametrize("name,d,n,kw", CASES)
@pytest.mark.parametrize("lowered", [False, True])
def test_round_trips(name, d, n, kw, lowered):
    s = build_schedule(name, d, n, **kw)
    if lowered:
        s = lower(s)
    assert Schedule.from_text(s.text()) == s
    assert from_json(to_json(s)) == s
    c = from_csv(to_csv(s), microbatches=s.microbatches, data_parallel=s.data_parallel,
                 microbatch_scale=s.microbatch_scale)
    assert c == s


def test_action_text_parses_back():
    for t in ["0F3", "u2B1", "d0F2-3", "d1RECV_F3", "5SEND_B0", "u3AR_START", "d0AR_WAIT", "OPT"]:
        a = Action.parse(t)
        assert a.text(with_pipe=t[0] in "du") == t
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse("x0F1")


def test_json_layout_matches_cli_contract():
    d = json.loads(to_json(build_schedule("1f1b", 2, 2)))
    assert d["workers"][0][0] == {"kind": "F", "pipe": "down", "stage": 0, "microbatch": 0}
    assert [len(w) for w in d["workers"]] == [4, 4]


def test_csv_reads_torch_style_rows():
    s = from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert s.stages == 2 and s.microbatches == 2 and s.placement == {("down", 0): 0, ("down", 1): 1}

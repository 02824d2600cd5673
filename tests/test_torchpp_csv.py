"""--schedule-file with the CSV torch.distributed.pipelining itself writes: Interleaved1F1B, InterleavedZeroBubble,
ZBVZeroBubble and DualPipeV at 4 ranks and 8 micro-batches load, validate, simulate and train to parity with
sequential training; a file that disagrees with the flags or with itself is refused naming the cell.

The files are made by torch's own schedule classes (real ``PipelineStage`` objects on a fake process group of 4
ranks, which torch ships for exactly this: one process playing one rank) and its ``_dump_csv``, both in its default
form (with sends, receives and FSDP actions) and compute-only, so a torch upgrade that changes them fails here.
"""

import csv
import io
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from test_runtime_parity import BASE, SGD, assert_parity
from torch.distributed import pipelining
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping, generate_stage_to_rank_mapping

from chimera.compile import compile_job
from chimera.config import ConfigError
from chimera.schedule import DOWN, Action, Costs, Kind, build_schedule, lower, simulate, to_csv
from chimera.schedule.generators import ScheduleConfigError
from chimera.schedule.io import from_csv, load_schedule_file
from chimera.schedule.lowering import add_p2p, in_channel_order
from chimera.schedule.replay import message_key
from chimera.schedule.torchpp import is_torch_csv

D, N = 4, 8
STYLE = {"ScheduleInterleaved1F1B": "loop", "ScheduleInterleavedZeroBubble": "loop", "ScheduleZBVZeroBubble": "v",
         "ScheduleDualPipeV": "v"}


@pytest.fixture(scope="module")
def torch_csvs(tmp_path_factory):
    """name -> {"comms": path, "compute": path}: torch's two dumps of each schedule, rank 0's view of all ranks."""
    out = tmp_path_factory.mktemp("torchpp")
    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=D)
    try:
        files = {}
        for name, style in STYLE.items():
            local = generate_rank_to_stage_mapping(D, 2 * D, style)[0]
            stages = [pipelining.PipelineStage(torch.nn.Linear(2, 2), s, 2 * D, torch.device("cpu")) for s in local]
            schedule = getattr(pipelining, name)(stages, N, loss_fn=lambda out, target: out.sum())
            files[name] = {"comms": out / f"{name}.csv", "compute": out / f"{name}.compute.csv"}
            schedule._dump_csv(str(files[name]["comms"]))  # its default: compute and communication
            schedule._dump_csv(str(files[name]["compute"]), format="compute_only")
    finally:
        dist.destroy_process_group()
    return files


def load(path, stages=D, microbatches=N):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_schedule_file(str(path), stages, microbatches)


@pytest.mark.parametrize("name", STYLE)
def test_torch_csv_loads_validates_and_simulates(torch_csvs, name):
    text = torch_csvs[name]["comms"].read_text()
    assert "UNSHARD" in text and "SEND_F" in text and "RECV_B" in text and "REDUCE_GRAD" in text
    note = r"dropped \d+ SEND_F/RECV_F/SEND_B/RECV_B: they agree with the placement.*dropped \d+ UNSHARD, \d+ " \
           r"RESHARD, \d+ REDUCE_GRAD: FSDP actions"
    with pytest.warns(UserWarning, match=note) as got:
        s = load_schedule_file(str(torch_csvs[name]["comms"]), D, N)  # validated inside
    assert ("OVERLAP_F_B as its forward, then its backward" in str(got[0].message)) == (name == "ScheduleDualPipeV")
    assert (s.workers, s.stages, s.microbatches, s.lowered, s.pipes) == (D, 2 * D, N, False, (DOWN,))
    assert s.placement == {(DOWN, st): r for st, r in generate_stage_to_rank_mapping(D, 2 * D, STYLE[name]).items()}
    assert load(torch_csvs[name]["compute"]) == s  # what was dropped held no compute
    for r, row in enumerate(csv.reader(io.StringIO(text))):  # an OVERLAP_F_B runs its forward, then its backward
        for f_stage, f_mb, b_stage, b_mb in re.findall(r"\((\d+)F(\d+);(\d+)B(\d+)\)OVERLAP_F_B", ",".join(row)):
            i = s.actions[r].index(Action(Kind.F, DOWN, int(f_stage), int(f_mb)))
            assert s.actions[r][i + 1] == Action(Kind.B, DOWN, int(b_stage), int(b_mb))
    r = simulate(s, Costs(fwd=1, bwd=1, wgrad=1))
    assert r.busy == [2 * N * 3] * D  # two stages x N micro-batches x (F + I + W): every compute action once
    assert r.makespan <= 2 * N * 3 * 1.2  # a bubble under a sixth of the step (57 for Interleaved1F1B, 51 the rest)


def test_interleaved_1f1b_is_our_interleaved_order(torch_csvs):
    s = load(torch_csvs["ScheduleInterleaved1F1B"]["comms"])
    ours = build_schedule("interleaved", D, N, chunks=2)
    for w in range(D):
        assert s.actions[w] == ours.actions[w], w
    assert s == ours
    costs = Costs(fwd=1, bwd=2)
    assert simulate(s, costs).makespan == simulate(ours, costs).makespan == 57


def test_v_placements_take_each_channel_in_send_order(torch_csvs):
    """ZBV and DualPipeV send stage s's activation and stage 2D-1-s's gradient to one rank over one channel; the
    lowering receives them in the order they leave, though torch's order has the rank need the later one first."""
    for name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        s = load(torch_csvs[name]["compute"])
        lowered = add_p2p(s)
        sends, recvs = _channel_orders(lowered)
        assert sends == recvs, name
        mixed = [ch for ch, msgs in sends.items() if len({(m.res, m.stage) for m in msgs}) > 1]
        assert mixed, name  # the case in point: two streams share a channel
        assert [[a for a in row if a.kind.is_compute] for row in lowered.actions] == [list(r) for r in s.actions]
    bitpipe = add_p2p(build_schedule("bitpipe", D, N))  # rows in channel order already are left as they are
    rows = [list(r) for r in bitpipe.actions]
    assert in_channel_order(rows, bitpipe.placement) == rows


def _channel_orders(s):
    """(sender, receiver, pipe) -> the messages in the order the sender sends them, and in the order the receiver
    receives them."""
    sends, recvs = {}, {}
    for w, row in enumerate(s.actions):
        for a in row:
            if a.kind.is_p2p:
                msg, peer = message_key(a, dict(s.placement))
                ch = (w, peer, a.pipe) if a.kind.is_send else (peer, w, a.pipe)
                (sends if a.kind.is_send else recvs).setdefault(ch, []).append(msg)
    return sends, recvs


@pytest.mark.parametrize("name", STYLE)
def test_torch_csv_trains_to_parity(torch_csvs, name):
    """bert-tiny cut into the file's 8 stages (one layer each); its tied embedding and decoder sit on one rank in the
    V placements, on ranks 0 and 3 in the interleaved ones."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_parity(BASE.with_flags(schedule_file=str(torch_csvs[name]["comms"]), stages=D, micro_batches=N,
                                      steps=2, model_overrides={"num_hidden_layers": 6}, **SGD))


def _edit(src, dst, row, old, new):
    """Torch's file ``src`` with the first cell ``old`` of ``row`` replaced by ``new`` (None: removed); its column."""
    rows = list(csv.reader(io.StringIO(src.read_text())))
    col = rows[row].index(old)
    if new is None:
        del rows[row][col]
    else:
        rows[row][col] = new
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    dst.write_text(buf.getvalue())
    return col + 1


def _refused(path, match, stages=D, microbatches=N):
    with pytest.raises(ScheduleConfigError, match=match) as e:
        load(path, stages, microbatches)
    assert "\n" not in str(e.value), str(e.value)  # one line
    assert "(a torch.distributed.pipelining CSV)" in str(e.value)


def test_counts_that_disagree_with_the_flags_are_refused(torch_csvs, tmp_path):
    zbv = torch_csvs["ScheduleZBVZeroBubble"]["comms"]
    cells = list(csv.reader(io.StringIO(zbv.read_text())))[0]
    col = cells.index("0F4") + 1
    _refused(zbv, rf"row 1 \(rank 0\), column {col} '0F4': micro-batch 4 is past --micro-batches 4: the file runs 8 "
             r"micro-batches on 4 ranks; pass --stages 4 --micro-batches 8$", microbatches=4)
    _refused(zbv, r"'0F7' runs the file's last micro-batch, 7, but --micro-batches is 16: .*pass --stages 4 "
             r"--micro-batches 8$", microbatches=16)
    _refused(zbv, r"the file has 4 rows, one per rank, but --stages is 8: pass --stages 4 --micro-batches 8 \(--stages "
             r"counts the ranks; the model is cut into the file's 8 stages\)$", stages=8)
    with pytest.raises(ConfigError, match="pass --stages 4 --micro-batches 8"):  # the same through the config
        compile_job(BASE.with_flags(schedule_file=str(zbv), stages=4, micro_batches=4,
                        model_overrides={"num_hidden_layers": 6}))


def test_cells_that_disagree_with_the_placement_are_refused(torch_csvs, tmp_path):
    comms, compute = torch_csvs["ScheduleInterleaved1F1B"]["comms"], torch_csvs["ScheduleInterleaved1F1B"]["compute"]
    bad = tmp_path / "bad.csv"
    col = _edit(compute, bad, 1, "1F3", "4F3")
    _refused(bad, rf"^[^:]*: row 2 \(rank 1\), column {col} '4F3': stage 4 already runs on rank 0 \(row 1 \(rank 0\), "
             rf"column \d+ '4F0'\); a stage lives on one rank: move the action to row 1 or fix its stage$")
    col = _edit(comms, bad, 0, "0SEND_F0", "1SEND_F0")
    _refused(bad, rf"row 1 \(rank 0\), column {col} '1SEND_F0': this send disagrees with the placement the compute "
             r"actions give: stage 1 runs on rank 1 \(row 2\), not on rank 0; fix or remove the cell")
    _edit(comms, bad, 1, "1RECV_F0", None)
    _refused(bad, r"row 2 \(rank 1\), column \d+ '1F0' needs '1RECV_F0' on rank 1 .* but row 2 has none: the file's "
             r"sends and receives disagree with its placement; add the cell, or give compute actions only")
    _edit(compute, bad, 3, "3F1", "3F0")
    _refused(bad, r"row 4 \(rank 3\), column \d+ '3F0': 3F0 runs twice \(also row 4 \(rank 3\), column \d+ '3F0'\); "
             r"remove one$")
    rows = [[re.sub(r"^7(?=[A-Z])", "9", c) for c in row] for row in csv.reader(io.StringIO(compute.read_text()))]
    bad.write_text("\n".join(",".join(r) for r in rows) + "\n")
    _refused(bad, r"stage 7 has no action in any row, but the file names stages up to 9: number the stages 0..7 without "
             r"gaps$")
    rows = list(csv.reader(io.StringIO(compute.read_text())))
    bad.write_text("\n".join(",".join(r) for r in [*rows[:2], ["", ""], *rows[2:]]) + "\n")
    _refused(bad, r"row 3 \(rank 2\) has no compute action \(F, B, I, W\): give every rank a stage or remove the row$",
             stages=5)
    rows = list(csv.reader(io.StringIO(torch_csvs["ScheduleZBVZeroBubble"]["comms"].read_text())))
    rows[3].insert(rows[3].index("3F0") + 1, "3SEND_F0")  # a hand-off between two stages of one rank: torch sends none
    bad.write_text("\n".join(",".join(r) for r in rows) + "\n")
    _refused(bad, r"'3SEND_F0': this send disagrees .*: stages 3 and 4 both run on rank 3: the activation is handed "
             r"over in memory, not sent")


def test_unknown_or_malformed_cells_are_refused(torch_csvs, tmp_path):
    comms = torch_csvs["ScheduleDualPipeV"]["comms"]
    bad = tmp_path / "bad.csv"
    _edit(comms, bad, 0, "0UNSHARD", "0PREFETCH")
    _refused(bad, r"row 1 \(rank 0\), column 1 '0PREFETCH': unknown torch action type 'PREFETCH' \(known: F, B, I, W, "
             r"SEND_F, RECV_F, SEND_B, RECV_B, UNSHARD, RESHARD, REDUCE_GRAD, OVERLAP_F_B\); fix the cell$")
    _edit(comms, bad, 0, "(0F7;7B3)OVERLAP_F_B", "(0F7;7SEND_B3)OVERLAP_F_B")
    _refused(bad, r"'\(0F7;7SEND_B3\)OVERLAP_F_B': OVERLAP_F_B holds compute actions \(F, B, I, W\) only, not SEND_B")
    _edit(comms, bad, 0, "0F0", "0F")
    _refused(bad, r"row 1 \(rank 0\), column \d+ '0F': F needs a micro-batch index, e.g. '0F0'$")
    _edit(comms, bad, 0, "0UNSHARD", "0UNSHARD3")
    _refused(bad, r"row 1 \(rank 0\), column 1 '0UNSHARD3': UNSHARD names a stage, not a micro-batch: write '0UNSHARD'$")
    _edit(comms, bad, 2, "2F0", "2F0x")
    _refused(bad, r"row 3 \(rank 2\), column \d+ '2F0x': not an action: torch writes \[stage\]\[type\]\[micro-batch\]")
    _edit(comms, bad, 0, "0UNSHARD", "OPT")
    with pytest.raises(ScheduleConfigError, match=r"row 1 \(rank 0\), column 1 'OPT' is chimera's syntax but row 1 "
                       r"\(rank 0\), column 2 '7UNSHARD' is torch.distributed.pipelining's: write the file in one of them"):
        load(bad)


def test_our_own_csv_and_json_still_read_as_ours():
    bi = build_schedule("chimera", 4, 8)
    assert not is_torch_csv(list(csv.reader(io.StringIO(to_csv(bi)))))  # pipe prefixes
    lowered_text = to_csv(lower(build_schedule("1f1b", 2, 4)))
    assert not is_torch_csv(list(csv.reader(io.StringIO(lowered_text))))  # OPT
    assert from_csv(lowered_text, microbatches=4) == lower(build_schedule("1f1b", 2, 4))
    one = build_schedule("zb-h1", 4, 8)  # single pipe, compute only: torch's syntax too, read the same either way
    assert is_torch_csv(list(csv.reader(io.StringIO(to_csv(one)))))
    assert from_csv(to_csv(one)) == one

"""What a worker does ahead of time while it waits for a message: receives posted ahead (gloo) and the next forward's
data loaded. Both move work off the step's critical path without changing what is computed (the parity tests run
every schedule with them)."""

from contextlib import nullcontext

import torch

from chimera.compile import compile_job
from chimera.config import TrainConfig
from chimera.microbatch import tensors
from chimera.models import build_stage
from chimera.runtime.batches import AHEAD_BATCHES, AHEAD_BYTES, _ahead
from chimera.runtime.compute import StageCompute
from chimera.runtime.executor import segments
from chimera.runtime.step_state import StepState


def test_small_receives_go_several_batches_ahead_large_ones_one():
    idx = list(range(0, 40, 2))  # communication batches at every other segment
    small = _ahead(idx, {k: 128 for k in idx})
    assert small[0] == idx[1:1 + AHEAD_BATCHES]
    assert small[idx[-3]] == idx[-2:]  # near the end: what is left
    assert small[idx[-1]] == []
    large = _ahead(idx, {k: AHEAD_BYTES + 1 for k in idx})
    assert all(v == [idx[i + 1]] for i, (k, v) in enumerate(large.items()) if k != idx[-1])  # the next batch, always
    # the extra buffers (beyond the next batch's) total at most AHEAD_BYTES
    mixed = _ahead(idx, {k: AHEAD_BYTES // 3 for k in idx})
    assert all(len(v) == 4 for k, v in mixed.items() if k <= idx[-5])


def _compute(worker: int, steps: int = 1) -> tuple[StageCompute, list, object]:
    cfg = TrainConfig.from_flags(model="gpt2-tiny", schedule="1f1b", stages=2, micro_batches=4, steps=steps, threads=1,
                                 corpus="synthetic", partition="uniform")
    job = compile_job(cfg)
    mods = {(p, s): build_stage(job.chain, job.stage_layers[s], job.run.seed) for p, s in job.schedule.stages_of(worker)}
    return StageCompute(job, mods, worker, 0, torch.device("cpu"), nullcontext()), segments(job.schedule.actions[worker]), job


def test_the_last_stage_loads_each_forwards_labels_while_it_waits_for_its_input():
    compute, segs, job = _compute(1)
    ahead = compute.data_ahead(segs)
    forwards = [(k, seg[0]) for k, seg in enumerate(segs) if seg[0].kind.value == "F"]
    assert len(forwards) == 4
    for k, f in forwards:  # the receive batch right before each forward maps to its micro-batch
        before = max(j for j in ahead if j < k)
        assert segs[before][0].kind.is_p2p and ahead[before] == [(f.pipe, mb) for mb in f.microbatches]
    st = StepState(3, torch.device("cpu"))
    k, f = forwards[1]
    compute.load_ahead(ahead[max(j for j in ahead if j < k)], st)
    loaded = st.data[(f.pipe, f.microbatch)]
    fresh = compute._data(f.pipe, f.microbatch, 3)
    assert all(torch.equal(a, b) for a, b in zip(loaded[1].values(), fresh[1].values()))  # the same micro-batch's labels
    # the forward takes what was loaded (and leaves nothing behind)
    st.inbox.update(_fake_input(job, f))
    compute.forward(f, st)
    assert not st.data and len(st.stash) == 1


def test_the_first_stage_loads_ahead_only_forwards_after_a_message():
    compute, segs, _ = _compute(0)
    ahead = compute.data_ahead(segs)
    first_f = next(k for k, seg in enumerate(segs) if seg[0].kind.value == "F")
    assert all(k > first_f for k in ahead)  # the step's first forward has no message before it
    assert ahead and all(segs[k][0].kind.is_p2p for k in ahead)


def test_the_first_stage_loads_the_next_steps_first_forward_in_its_steps_last_batch():
    compute, segs, job = _compute(0, steps=6)
    last, units = compute.next_step_ahead(segs)
    first_f = next(seg[0] for seg in segs if seg[0].kind.value == "F")
    assert units == [(first_f.pipe, first_f.microbatch)]  # the step's first forward: no message before it
    assert last == max(k for k, seg in enumerate(segs) if seg[0].kind.is_p2p)
    compute.load_next(units, StepState(job.run.steps - 1, torch.device("cpu")))  # the run has no step after it
    assert compute.preloaded == {}
    compute.load_next(units, StepState(3, torch.device("cpu")))
    assert list(compute.preloaded) == [(4, first_f.pipe, first_f.microbatch)]
    compute.preloaded[(2, first_f.pipe, 1)] = compute._data(first_f.pipe, 1, 2)  # older: dropped when step 4 starts
    st = StepState(4, torch.device("cpu"))
    compute.start_step(st)
    assert compute.preloaded == {} and list(st.data) == [(first_f.pipe, first_f.microbatch)]
    fresh = compute._data(first_f.pipe, first_f.microbatch, 4)
    loaded = st.data[(first_f.pipe, first_f.microbatch)]
    assert all(torch.equal(a, b) for a, b in zip(loaded[0].values(), fresh[0].values()))  # step 4's own inputs
    compute.forward(first_f, st)  # the forward takes what was loaded
    assert not st.data and len(st.stash) == 1
    # the memory ledger counts what waits for the next step (with the step's activations)
    from chimera.runtime.ledger import MemoryLedger

    ledger = MemoryLedger(None, None, compute=compute)
    assert ledger._preloaded() == []
    compute.load_next(units, st)
    held = ledger._preloaded()
    assert held and all(any(t is h for h in held) for t in tensors(list(compute.preloaded.values())))


def test_a_worker_with_no_message_loads_nothing_ahead():
    cfg = TrainConfig.from_flags(model="gpt2-tiny", schedule="1f1b", stages=1, micro_batches=2, steps=1, threads=1,
                                 corpus="synthetic", partition="uniform")
    job = compile_job(cfg)
    mods = {(p, s): build_stage(job.chain, job.stage_layers[s], job.run.seed) for p, s in job.schedule.stages_of(0)}
    compute = StageCompute(job, mods, 0, 0, torch.device("cpu"), nullcontext())
    segs = segments(job.schedule.actions[0])
    assert compute.next_step_ahead(segs) is None and compute.data_ahead(segs) == {}


def _fake_input(job, f):
    from chimera.schedule.kinds import Msg, Res

    specs = job.stage_inputs(f.stage)
    return {Msg(Res.ACT, f.pipe, f.stage - 1, f.microbatch): tuple(torch.zeros(s.shape, dtype=s.dtype) for s in specs)}


class _Posts:
    """The communicator's side of a batch, recorded: each bound send, and what each ``post`` call carried (a
    stand-in for the process group a real communicator needs; its works complete at once)."""

    prefetch_recvs = True

    def __init__(self) -> None:
        self.calls: list[list[bool]] = []  # per send ([True]) or post call (each op's is_send)
        self.pipe_groups = {"down": None}

    def global_rank(self, worker: int) -> int:
        return worker

    def sender(self, peer: int, group):
        return lambda t: self.calls.append([True])

    def post(self, ops):
        self.calls.append([op.is_send for op in ops])
        return [None] * len(ops)

    def wait(self, work, what) -> None:
        pass


def test_a_batch_posts_its_sends_before_it_makes_any_receive_buffer():
    from chimera.runtime.batches import CommBatches

    _, segs, job = _compute(0)
    comm = _Posts()
    batches = CommBatches(comm, job, 0, segs, torch.device("cpu"), lambda a, step: a.text())
    k = next(k for k in batches.sends if batches.sends[k] and batches.recvs[k])  # 1F1B's steady state: SEND_F, RECV_B
    st = StepState(0, torch.device("cpu"))
    for _, msg, *_ in batches.sends[k]:
        st.outbox[msg] = (torch.zeros(2, 3),)
    batches.exchange(k, st)
    n = len(batches.sends[k])
    assert comm.calls[:n] == [[True]] * n  # the sends, each as it is taken from the outbox
    assert comm.calls[n] and not any(comm.calls[n])  # then the receives (this batch's and those posted ahead)
    assert all(m in st.inbox for _, m, *_ in batches.recvs[k])
    comm.prefetch_recvs = False  # NCCL: one post per batch, sends and receives together (one group call)
    nccl = CommBatches(comm, job, 0, segs, torch.device("cpu"), lambda a, step: a.text())
    comm.calls.clear()
    for _, msg, *_ in nccl.sends[k]:
        st.outbox[msg] = (torch.zeros(2, 3),)
    nccl.exchange(k, st)
    assert len(comm.calls) == 1 and comm.calls[0][0] and not all(comm.calls[0])

"""The simulator against a plain reference replay, its exact integer path, per-stage message sizes, and the
preparation it keeps per schedule."""

import dataclasses
import gc
import importlib
import weakref
from collections import Counter, defaultdict
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from chimera.schedule import Costs, ScheduleError, build_schedule, lower, simulate
from chimera.schedule.ir import DOWN, UP, Action, B, F, Kind, from_rows
from chimera.schedule.kinds import SPECS, Msg, Res, Role, message
from chimera.schedule.replay import Replay
from chimera.schedule.simulate import Simulator

simulate_module = importlib.import_module("chimera.schedule.simulate")  # the package exports simulate()


def reference(schedule, costs):
    """The replay rules of chimera.schedule.replay, written plainly: sweep the workers, run each one's next
    action while it can, until no worker moves. Returns (starts, ends, {stuck worker: step})."""
    place, rows, scale = schedule.placement, schedule.actions, schedule.microbatch_scale
    replicas = Counter(s for _, s in place)
    awaited = {u.res for s in SPECS.values() if s.role is Role.COMPUTE for u in s.consumes}
    done, arrivals = {}, defaultdict(list)
    clock, pc = [0] * len(rows), [0] * len(rows)
    starts, ends = [[None] * len(r) for r in rows], [[None] * len(r) for r in rows]
    moved = True
    while moved:
        moved = False
        for w, row in enumerate(rows):
            while pc[w] < len(row):
                a, now = row[pc[w]], clock[w]
                spec = SPECS[a.kind]
                if spec.role is Role.COMPUTE:
                    inputs = []
                    for use in spec.consumes:
                        src = a.stage + use.offset
                        remote = src != a.stage and place.get((a.pipe, src)) != w
                        if 0 <= src < schedule.stages and not (remote and schedule.lowered):
                            inputs += [(Msg(use.res, a.pipe, src, m), remote) for m in a.microbatches]
                    if any(k not in done for k, _ in inputs):
                        break
                    start = max([now] + [done[k] + (costs.message(k) if remote else 0) for k, remote in inputs])
                    end = start + costs.of(a, scale)
                    for res in spec.produces:
                        if res in awaited:
                            done.update({Msg(res, a.pipe, a.stage, m): end for m in a.microbatches})
                elif spec.role is Role.SEND:  # busy posting it, then the message leaves
                    key = message(a.kind, a.pipe, a.stage, a.microbatch)[0]
                    start, end = now, now + costs.p2p_busy
                    done[("msg", key)] = end + costs.message(key)
                elif spec.role is Role.RECV:  # waits for the message, then busy completing it
                    key = ("msg", message(a.kind, a.pipe, a.stage, a.microbatch)[0])
                    if key not in done:
                        break
                    start, end = now, max(now, done[key]) + costs.p2p_busy
                elif spec.role is Role.SYNC_START:
                    start, end = now, now + costs.stage_value(costs.sync_start, a.stage)
                    arrivals[a.stage].append(end)
                    if len(arrivals[a.stage]) == replicas[a.stage]:
                        done[("AR", a.stage)] = max(arrivals[a.stage]) + costs.stage_value(costs.allreduce, a.stage)
                elif spec.role is Role.SYNC_WAIT:
                    if ("AR", a.stage) not in done:
                        break
                    start, end = now, max(now, done[("AR", a.stage)]) + costs.stage_value(costs.sync_wait, a.stage)
                else:
                    start, end = now, now + costs.of(a, scale)
                starts[w][pc[w]], ends[w][pc[w]] = start, end
                clock[w], pc[w], moved = end, pc[w] + 1, True
    return starts, ends, {w: pc[w] for w, row in enumerate(rows) if pc[w] < len(row)}


@st.composite
def cases(draw):
    """A small generated schedule (compute-only or lowered), maybe with steps swapped or dropped, and costs."""
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "chimera"]))
    d = draw(st.integers(1, 6))
    kw = {}
    if name == "chimera":
        d = max(2, d - d % 2)
        kw["mode"] = draw(st.sampled_from(["direct", "halving"]))
    if name == "interleaved":
        kw["chunks"] = draw(st.integers(1, 3))
    n = d * draw(st.integers(1, 3))
    s = build_schedule(name, d, n, data_parallel=draw(st.integers(1, 2)), **kw)
    if draw(st.booleans()):
        s = lower(s)
    rows = [list(r) for r in s.actions]
    for _ in range(draw(st.integers(0, 3))):  # neighbours swapped or a step dropped: often a deadlock
        row = rows[draw(st.integers(0, len(rows) - 1))]
        i = draw(st.integers(0, len(row) - 2)) if len(row) > 1 else 0
        if draw(st.booleans()) and len(row) > 1:
            row[i], row[i + 1] = row[i + 1], row[i]
        elif draw(st.integers(0, 3)) == 0 and len(row) > 1:
            row.pop(i)
    assume(any(a.kind in (Kind.F, Kind.B) for r in rows for a in r))  # drops can leave a lowered list with neither
    s = from_rows(rows, name=s.name, microbatches=s.microbatches, stages=s.stages, data_parallel=s.data_parallel,
                  microbatch_scale=s.microbatch_scale)
    stages = s.stages
    value = st.integers(0, 5)
    if draw(st.integers(0, 3)) == 0:
        value = st.fractions(0, 5, max_denominator=6)
    per_stage = st.one_of(value, st.lists(value, min_size=stages, max_size=stages))
    costs = Costs(fwd=draw(per_stage), bwd=draw(per_stage), p2p_latency=draw(value), allreduce=draw(per_stage),
                  optimizer=draw(value))
    if draw(st.booleans()):  # communication that also occupies the worker
        costs = dataclasses.replace(costs, p2p_busy=draw(value), sync_start=draw(per_stage), sync_wait=draw(per_stage))
    return s, costs


@settings(max_examples=200, deadline=None)
@given(cases())
def test_prepared_simulation_equals_plain_replay(case):
    s, costs = case
    starts, ends, stuck = reference(s, costs)
    if stuck:
        with pytest.raises(ScheduleError, match="deadlock") as e:
            simulate(s, costs)
        assert all(f">{s.actions[w][i].text(s.bidirectional)}<" in str(e.value) for w, i in stuck.items())
        assert {w: i for w, (i, _) in Replay(s).stuck.items()} == stuck
        return
    r = simulate(s, costs)
    assert r.starts == starts and r.ends == ends
    assert r.makespan == max(e for row in ends for e in row) - min(t for row in starts for t in row)
    floats = simulate(s, dataclasses.replace(costs, fwd=_floats(costs.fwd), bwd=_floats(costs.bwd)))
    assert floats.makespan == pytest.approx(float(r.makespan)) and isinstance(floats.makespan, float)


def _floats(v):
    return [float(x) for x in v] if isinstance(v, list) else float(v)


def test_integer_costs_compute_in_ints_and_equal_fractions():
    s = build_schedule("chimera", 8, 16)
    exact = simulate(s, Costs(fwd=Fraction(1), bwd=Fraction(2), p2p_latency=Fraction(1, 1)))
    ints = simulate(s, Costs(fwd=1, bwd=2, p2p_latency=1))
    assert type(exact.makespan) is int and all(type(t) is int for row in exact.ends for t in row)
    assert (exact.makespan, exact.busy, exact.bubble, exact.ends) == (ints.makespan, ints.busy, ints.bubble, ints.ends)
    assert isinstance(exact.bubble, Fraction)
    # thirds (and halving's halves) stay exact: integers over the common denominator, Fractions out
    third = simulate(build_schedule("chimera", 4, 8, mode="halving"), Costs(fwd=Fraction(1, 3), bwd=1))
    starts, ends, _ = reference(third.schedule, Costs(fwd=Fraction(1, 3), bwd=1))
    assert third.starts == starts and third.ends == ends and isinstance(third.makespan, Fraction)
    assert third.bubble == 1 - Fraction(sum(third.busy)) / (4 * third.makespan)


def test_per_stage_message_bytes():
    # 1F1B, D = 3, one micro-batch: every hand-off crosses workers; an activation costs its stage's output bytes
    # / 10, a gradient (of a stage's input) the previous stage's output bytes / 10
    costs = Costs(fwd=1, bwd=1, p2p_bytes=[10, 20, 30], p2p_bandwidth=Fraction(10))
    s = build_schedule("1f1b", 3, 1)
    # F0 0-1, act(0) 1 -> F1 2-3, act(1) 2 -> F2 5-6, B2 6-7, grad(2) 2 -> B1 9-10, grad(1) 1 -> B0 11-12
    assert simulate(s, costs).makespan == 12
    assert simulate(lower(s), costs).makespan == 12
    assert costs.of(Action(Kind.SEND_GRAD, DOWN, 2, 0)) == 2 and costs.of(Action(Kind.RECV_ACT, DOWN, 2, 0)) == 2
    assert costs.message(Msg(Res.ACT, UP, 0, 5)) == 1
    assert Costs(p2p_latency=1, p2p_bytes=10, p2p_bandwidth=5).message() == 3  # the scalar form
    with pytest.raises(ValueError, match="per-stage p2p_bytes"):
        costs.message()


def test_one_preparation_per_schedule(monkeypatch):
    plans = []
    monkeypatch.setattr(simulate_module, "Replay", lambda s, *a: plans.append(s.name) or Replay(s, *a))
    s = build_schedule("chimera", 4, 8)
    runs = [simulate(s, Costs(fwd=f, bwd=2 * f)) for f in (1, 2, 0.5)]
    assert len(plans) == 1 and [r.makespan for r in runs] == [runs[0].makespan * f for f in (1, 2, 0.5)]
    sim = Simulator(lower(s))
    assert sim.run(Costs(fwd=1, bwd=2)).makespan == runs[0].makespan and len(plans) == 2
    ref = weakref.ref(s)
    del s, runs
    gc.collect()
    assert ref() is None  # the kept preparation does not keep the schedule alive


def test_simulate_reports_a_deadlock_with_the_grid():
    rows = [[F(UP, 1, 0), B(UP, 1, 0), F(DOWN, 0, 0), B(DOWN, 0, 0)],
            [F(DOWN, 1, 0), B(DOWN, 1, 0), F(UP, 0, 0), B(UP, 0, 0)]]
    with pytest.raises(ScheduleError, match="cannot simulate custom: deadlock") as e:
        simulate(from_rows(rows, microbatches=2))
    assert "u1F0 needs the act of stage 0 micro-batch 0 (made on worker 1)" in str(e.value)
    assert ">u1F0<" in str(e.value) and ">d1F0<" in str(e.value)
    with pytest.raises(ScheduleError, match="waits for worker 1 to send it"):
        simulate(lower(from_rows(rows, microbatches=2)))


def test_a_role_without_replay_rule_is_refused(monkeypatch):
    spec = SPECS[Kind.OPTIMIZER_STEP]
    monkeypatch.setitem(SPECS, Kind.OPTIMIZER_STEP, dataclasses.replace(spec, role="teleport"))
    with pytest.raises(ValueError, match="no rule for the role"):
        Replay(build_schedule("1f1b", 2, 2))


def test_communication_busy_time_occupies_the_worker():
    """1F1B, D = 2, one micro-batch: each of the 4 sends and receives on the critical path adds its busy time,
    a send's message leaving only after it; a gradient sum's start and wait add theirs on both replicas."""
    s = lower(build_schedule("1f1b", 2, 1))
    assert simulate(s, Costs(fwd=1, bwd=1)).makespan == 4
    assert simulate(s, Costs(fwd=1, bwd=1, p2p_busy=1)).makespan == 8
    assert simulate(s, Costs(fwd=1, bwd=1, p2p_busy=1, p2p_latency=2)).makespan == 12
    dp = lower(build_schedule("1f1b", 1, 1, data_parallel=2))
    assert simulate(dp, Costs(fwd=1, bwd=1, allreduce=3)).makespan == 5
    assert simulate(dp, Costs(fwd=1, bwd=1, allreduce=3, sync_start=[1], sync_wait=[2])).makespan == 8


def test_workers_sharing_a_core_take_it_in_turn():
    """Chimera at D = 2, N = 2, both workers on one core; F sleeps 4 and B 8 beyond the runtime's 1 each (the part that
    holds the core). By hand: at 0 both forwards are ready, worker 0 (lower index) holds the core for 1, worker 1
    starts at 1; at 6 both next forwards are ready, worker 1 again one behind; the last backwards both wait for
    worker 1's d1B0 (ends 21), worker 1's a unit behind: 31, against 28 with a core each. With the compute on the
    CPU too, the core never idles: 2 x (5 + 5 + 9 + 9) = 56."""
    s = build_schedule("chimera", 2, 2)
    base = Costs(fwd=4, bwd=8, fixed=(("F", 1), ("B", 1)))
    assert simulate(s, base).makespan == 28
    assert simulate(s, dataclasses.replace(base, cores=(0, 1), cpu_compute=False)).makespan == 28
    r = simulate(s, dataclasses.replace(base, cores=(0, 0), cpu_compute=False))
    assert (r.makespan, r.starts) == (31, [[0, 6, 11, 21], [1, 7, 12, 22]])
    r = simulate(s, dataclasses.replace(base, cores=(0, 0)))
    assert (r.makespan, r.starts) == (56, [[0, 10, 20, 38], [5, 15, 29, 47]])
    with pytest.raises(ValueError, match="one per worker"):
        simulate(s, dataclasses.replace(base, cores=(0, 0, 1)))


@settings(max_examples=150, deadline=None)
@given(cases(), st.data())
def test_workers_on_cores_time_every_action_once_its_core_is_free(case, data):
    """The event-ordered pass (``Costs.cores``): with a core each it times as the replay does; with shared cores
    no action ends earlier than with a core each, and no two actions hold one core at once (an action holds it from
    its duration's start, for its core time)."""
    s, costs = case
    assume(not Replay(s).stuck)
    plain = simulate(s, costs)
    own = simulate(s, dataclasses.replace(costs, cores=tuple(range(s.workers))))
    assert (own.starts, own.ends) == (plain.starts, plain.ends)
    n = data.draw(st.integers(1, max(1, s.workers - 1)))
    cores = tuple(data.draw(st.integers(0, n - 1)) for _ in range(s.workers))
    shared = dataclasses.replace(costs, cores=cores, cpu_compute=data.draw(st.booleans()),
                                 fixed=(("F", Fraction(1, 2)), ("B", 1)))
    r, alone = simulate(s, shared), simulate(s, dataclasses.replace(shared, cores=()))
    holds = defaultdict(list)
    for w, row in enumerate(s.actions):
        for a, end, end_alone in zip(row, r.ends[w], alone.ends[w]):
            assert end >= end_alone
            took = shared.worker_time(a, s.microbatch_scale)
            hold = min(shared.core_time(a, s.microbatch_scale), took)
            if hold:
                holds[cores[w]].append((end - took, end - took + hold))
    for spans in holds.values():
        spans.sort()
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))

"""The runtime's fixed time per action: priced by the simulator per action of its kind (``Costs.fixed``) and
measured by running the runtime itself (``chimera.calibrate``)."""

import pytest

from chimera.calibrate import KINDS, measure_action_costs
from chimera.schedule import Costs, build_schedule, simulate


def test_fixed_time_is_charged_once_per_action_of_its_kind():
    """1F1B, D = N = 2, F = 1, B = 2: 9 units. With 0.5 more per F and per B every action on the critical path
    grows: w0 F0 0-1.5, w1 F0 1.5-3, B0 3-5.5, F1 5.5-7, B1 7-9.5, w0 B1 9.5-12."""
    s = build_schedule("1f1b", 2, 2)
    base = Costs(fwd=1, bwd=2)
    assert simulate(s, base).makespan == 9
    assert simulate(s, Costs(fwd=1, bwd=2, fixed=(("F", 0.5), ("B", 0.5)))).makespan == 12
    assert simulate(s, Costs(fwd=1, bwd=2, fixed=(("W", 5),))).makespan == 9  # no W in a whole backward
    doubled = build_schedule("chimera", 2, 4, mode="doubling")  # one F over two micro-batches: charged once
    plain = simulate(doubled, base).busy[0]
    assert simulate(doubled, Costs(fwd=1, bwd=2, fixed=(("F", 1),))).busy[0] == plain + sum(
        a.kind.value == "F" for a in doubled.actions[0])


@pytest.mark.timeout(120)
def test_the_runtime_measures_a_positive_fixed_time_per_compute_kind():
    fixed = measure_action_costs(2, steps=5, skip=2)
    assert set(fixed) == set(KINDS)
    assert all(0 < v < 0.05 for v in fixed.values()), fixed  # sub-millisecond on an idle machine; never a sleep
    with pytest.raises(ValueError, match="workers >= 2"):
        measure_action_costs(1)


@pytest.mark.timeout(120)
def test_with_sleeping_blocks_the_fixed_time_is_what_an_action_takes_beyond_its_sleeps():
    """Blocks sleeping 5 ms: every kind's figure is its interval less its sleeps (F, I, W one each, B two; the first
    stage's I none and its W two): positive and under one sleep. A worker that sleeps pays more per action than
    one that never does (the wake-up), which a zero-sleep calibration misses (bench/predict.py)."""
    fixed = measure_action_costs(2, steps=5, skip=2, sleep_s=0.005)
    assert set(fixed) == set(KINDS)
    assert all(0 < v < 0.005 for v in fixed.values()), fixed
    with pytest.raises(ValueError, match="sleep_s"):
        measure_action_costs(2, sleep_s=-1.0)


def test_a_profile_carries_the_runtime_costs_into_the_planners_simulation(tmp_path):
    """A profile with the runtime's time per action (``chimera profile --comm local`` measures it) keeps it in its
    file (an older file reads none) and the planner's costs charge it: 1F1B at D = 2, N = 4 with 1 ms more per F
    and per B takes 10 ms longer (10 actions on its critical path)."""
    import dataclasses

    from chimera.plan.costs import simulator_costs
    from chimera.profile import Profile
    from chimera.profile.synthetic import layer, profile

    prof = profile([layer(i, 0.002, 10_000, 10_000, 1_000, (2,)) for i in range(4)], (2,))
    timed = dataclasses.replace(prof, actions={"F": 0.001, "B": 0.001})
    loaded = Profile.load(timed.save(tmp_path / "p.json"))
    assert loaded.actions == {"F": 0.001, "B": 0.001}
    old = timed.to_dict()
    del old["actions"]
    assert Profile.from_dict(old).actions == {}
    s = build_schedule("1f1b", 2, 4)
    layers = [[0, 1], [2, 3]]
    plain = simulate(s, simulator_costs(prof, layers, 2, False, s)).makespan
    charged = simulate(s, simulator_costs(loaded, layers, 2, False, s)).makespan
    # the critical path of 1F1B at D = 2, N = 4: worker 0's first forward, then worker 1's 8 actions, then worker
    # 0's last backward: 10 actions, each 1 ms longer
    assert charged - plain == pytest.approx(0.010)


def test_what_a_step_pays_beyond_its_actions_is_its_time_less_its_simulation():
    """``step_remainder``: the median over the measured runs of step less simulation (never below 0)."""
    from chimera.calibrate import RuntimeRun, step_remainder
    from chimera.schedule import lower

    s = lower(build_schedule("1f1b", 2, 4))
    costs = lambda run: Costs(fwd=1, bwd=2)  # noqa: E731
    span = simulate(s, Costs(fwd=1, bwd=2)).makespan  # 15

    def runs(*steps: float) -> list[RuntimeRun]:
        return [RuntimeRun(s, False, step, {}) for step in steps]

    assert step_remainder(runs(span + 5, span + 1, span + 2), costs) == 2  # the median, not the mean
    assert step_remainder(runs(span - 1), costs) == 0  # a simulation longer than the step: nothing left over


def test_a_profile_charges_its_step_remainder_once_per_step(tmp_path):
    """``Profile.step_s`` (``chimera profile --comm local``) survives the file (an older file reads 0) and the
    planner's costs charge it once per step: on the optimizer step of a drained lowering, spread over a worker's
    stage updates in a post-validated one."""
    import dataclasses

    from chimera.offload.lowering import lower as lower_all
    from chimera.plan.costs import simulator_costs
    from chimera.profile import Profile
    from chimera.profile.synthetic import layer, profile
    from chimera.schedule import lower

    prof = profile([layer(i, 0.002, 10_000, 10_000, 1_000, (2,)) for i in range(4)], (2,))
    timed = dataclasses.replace(prof, step_s=0.004)
    loaded = Profile.load(timed.save(tmp_path / "p.json"))
    assert loaded.step_s == 0.004
    old = timed.to_dict()
    del old["step_s"]
    assert Profile.from_dict(old).step_s == 0
    from chimera.profile import ProfileError

    for bad in (-1.0, "1", None, float("nan")):
        with pytest.raises(ProfileError, match="step_s must be seconds >= 0"):
            Profile.from_dict({**old, "step_s": bad})
    layers = [[0, 1], [2, 3]]
    s = build_schedule("chimera", 2, 4)  # two stages per worker
    plain, charged = (simulator_costs(p, layers, 2, False, s, "sgd") for p in (prof, loaded))
    assert charged.optimizer - plain.optimizer == pytest.approx(0.004)
    assert simulate(lower(s), charged).makespan - simulate(lower(s), plain).makespan == pytest.approx(0.004)
    updates = [dict(c.extra)["stage_update"] for c in (plain, charged)]
    assert [b - a for a, b in zip(*updates)] == pytest.approx([0.002, 0.002])
    pv = lower_all(s, None, True)  # post-validated: each stage updated on its own, the worker's two updates 2 ms more
    assert simulate(pv, charged).makespan - simulate(pv, plain).makespan == pytest.approx(0.004)


def test_a_send_kinds_fixed_time_is_charged_per_send_beyond_its_busy_time():
    """``Costs.fixed`` of a send kind: on top of ``p2p_busy``, once per send. Lowered 1F1B at D = 2, N = 1, F = 1,
    B = 2, 0.25 busy per message: worker 0's F0 0-1, SEND_F0 1-1.25, worker 1's RECV_F0 ends at 1.5, F0 1.5-2.5,
    B0 2.5-4.5, SEND_B0 4.5-4.75, worker 0's RECV_B0 ends at 5 and its B0 at 7. With 0.5 more per send: 8."""
    from chimera.schedule import lower

    s = lower(build_schedule("1f1b", 2, 1))
    assert simulate(s, Costs(fwd=1, bwd=2, p2p_busy=0.25)).makespan == 7
    slower = (("SEND_F", 0.5), ("SEND_B", 0.5))
    assert simulate(s, Costs(fwd=1, bwd=2, p2p_busy=0.25, fixed=slower)).makespan == 8
    assert simulate(s, Costs(fwd=1, bwd=2, p2p_busy=0.25, fixed=(("RECV_F", 0.5),))).makespan == 7.5


def test_send_times_are_the_intervals_per_send_of_batches_of_sends_alone():
    """A batch's sends and receives share its interval; only batches of sends alone count (a receive may have
    waited for its peer), per send, less ``p2p_s``."""
    from chimera.calibrate import send_times
    from chimera.timeline.events import Event

    events = [Event(0, "SEND_F", "d", 0, 0, 1.0, 1.4, 3), Event(0, "SEND_B", "d", 1, 0, 1.0, 1.4, 3),  # two sends
              Event(0, "F", "d", 0, 1, 1.4, 2.0, 3),
              Event(0, "SEND_F", "d", 0, 1, 2.0, 2.9, 3), Event(0, "RECV_B", "d", 0, 0, 2.0, 2.9, 3),  # with a receive
              Event(1, "RECV_F", "d", 1, 0, 1.5, 1.6, 3),  # a receive alone
              Event(1, "SEND_B", "d", 1, 0, 1.5, 1.6, 4)]  # the next step's batch: its own
    assert send_times(events, 0.05) == pytest.approx([0.15, 0.05])


@pytest.mark.timeout(120)
def test_the_calibration_measures_each_backward_form_on_its_own():
    """``measure_runtime``: 1F1B with a whole backward (F and B) and with a split one (F, I, W), each with its
    schedule, its steps and a positive time per send beyond ``p2p_s`` (a send copies and wakes its peer)."""
    from chimera.calibrate import measure_runtime

    whole, split = measure_runtime(2, steps=6, skip=2, p2p_s=1e-6)
    assert (whole.split, split.split) == (False, True)
    assert set(whole.fixed) == {"F", "B", "SEND_F", "SEND_B", "AR_START", "AR_WAIT"}
    assert set(split.fixed) == {"F", "I", "W", "SEND_F", "SEND_B", "AR_START", "AR_WAIT"}
    for run in (whole, split):
        assert 0 < run.fixed["SEND_F"] == run.fixed["SEND_B"] < 0.05 and 0 < run.step_s < 1
        assert any(a.kind.value == "W" for row in run.schedule.actions for a in row) is run.split
        # the gradient sums come from the replica job, the same figures in both runs; 1F1B itself has none
        assert 0 < run.fixed["AR_START"] < 0.05 and 0 <= run.fixed["AR_WAIT"] < 0.05
        assert not any(a.kind.value == "AR_START" for row in run.schedule.actions for a in row)
    assert (whole.fixed["AR_START"], whole.fixed["AR_WAIT"]) == (split.fixed["AR_START"], split.fixed["AR_WAIT"])
    # an odd number of workers has no Chimera to measure sums on: none are priced; the sums' job takes its own N
    (odd, _) = measure_runtime(3, steps=5, skip=2)
    assert "AR_START" not in odd.fixed and "AR_WAIT" not in odd.fixed
    (any_n, _) = measure_runtime(2, steps=5, skip=2, micro_batches=3)  # Chimera refuses N = 3 at D = 2
    assert any_n.fixed["AR_START"] > 0


def test_sync_times_are_a_sums_start_beyond_its_busy_time_and_its_wait_after_the_peers_bucket():
    """``sync_times``: a start's interval less ``p2p_s``; a wait from the other replica's start of the same stage and
    step (its end plus the flight ``p2p_s``), or from its own start where that is later; medians by kind."""
    from chimera.calibrate import sync_times
    from chimera.timeline.events import Event

    events = [Event(0, "AR_START", "d", 0, -1, 1.0, 1.3, 5), Event(1, "AR_START", "u", 0, -1, 2.0, 2.5, 5),
              Event(0, "AR_WAIT", "d", 0, -1, 1.4, 2.8, 5),  # waits for worker 1's start: from 2.5 + 0.1
              Event(1, "AR_WAIT", "u", 0, -1, 3.0, 3.2, 5),  # worker 0's bucket long there: from its own start
              Event(0, "AR_START", "d", 1, -1, 4.0, 4.2, 5),  # stage 1's sum: no other replica recorded
              Event(0, "AR_WAIT", "d", 1, -1, 4.2, 4.9, 5),
              Event(1, "AR_WAIT", "u", 0, -1, 6.0, 6.9, 6)]  # another step: worker 0's start of step 5 does not count
    got = sync_times(events, 0.1)
    assert got == pytest.approx({"AR_START": 0.2, "AR_WAIT": 0.2})  # starts 0.2, 0.4, 0.1; waits 0.2, 0.2
    assert sync_times(events[:1], 0.1) == {}  # no wait: nothing priced


def test_the_benchmarks_two_calibrations_average_figure_by_figure():
    """``bench.predict.Calibration.mean``: the benchmark's calibrations before and after the rows, averaged per kind
    (a kind one side lacks keeps the other's figure), per step and for the link; and so is the prediction's price."""
    from bench.predict import Calibration, RuntimeCosts

    a = Calibration(1e-4, RuntimeCosts((("F", 4e-4), ("B", 6e-4)), 2e-3), RuntimeCosts((("F", 4e-4), ("I", 5e-4)), 1e-3),
                    (0, 1))
    b = Calibration(3e-4, RuntimeCosts((("F", 2e-4), ("B", 2e-4)), 4e-3), RuntimeCosts((("F", 6e-4), ("W", 1e-4)), 0.0),
                    (0, 1))
    m = a.mean(b)
    assert m.p2p_s == pytest.approx(2e-4) and m.cores == (0, 1)
    assert dict(m.whole.fixed) == pytest.approx({"F": 3e-4, "B": 4e-4}) and m.whole.step_s == pytest.approx(3e-3)
    assert dict(m.split.fixed) == pytest.approx({"F": 5e-4, "I": 5e-4, "W": 1e-4}) and m.split.step_s == 5e-4
    sched = build_schedule("1f1b", 2, 4)
    assert m.costs(0.01, sched).fixed == m.whole.fixed  # a whole backward priced with the whole runs' mean
    with pytest.raises(ValueError, match="different cores"):
        a.mean(Calibration(1e-4, a.whole, a.split, (0, 0)))

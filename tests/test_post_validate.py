"""Post-validated optimizer steps (``--post-validate``): per-stage updates, checked against the global gradient norm at
the end of the step, rolled back exactly and redone (clipping) or skipped (a non-finite norm)."""

import math

import pytest
import torch

from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.runtime import run_local, stage_params_by_layer, train_sequential
from chimera.schedule import Costs, Kind, build_schedule, lower, post_validate, validate
from chimera.schedule.steps import simulate_steps
from tests.postval_chain import POISONED

pytestmark = pytest.mark.timeout(120)

MLP = TrainConfig.from_flags(chain="tests.postval_chain:mlp", micro_batch_size=2, steps=5, optimizer="adamw", lr=1e-2,
                             timeout_s=60, threads=1, partition="uniform", check_replicas=True, post_validate=True)


def _states(res) -> dict:  # noqa: ANN001
    return {(rank, key, name): t for rank, state in res.states.items() for key, params in state.items()
            for name, t in params.items()}


def assert_reference(job, res) -> None:  # noqa: ANN001
    """Per-step loss within 1e-6, the norm within 1e-5 relative (both NaN where not finite), every parameter within
    1e-5 of sequential training with the same post-validation semantics; every parameter finite."""
    ref = train_sequential(job)
    for m, loss, norm in zip(res.metrics, ref.losses, ref.grad_norms):
        assert abs(m["loss"] - loss) <= 1e-6, (m["step"], m["loss"], loss)
        assert (math.isnan(m["grad_norm"]) and math.isnan(norm)) or \
            abs(m["grad_norm"] - norm) <= 1e-5 * max(1.0, norm), (m["step"], m["grad_norm"], norm)
    for state in res.states.values():
        for (_, stage), params in state.items():
            for k, v in stage_params_by_layer(params, job.stage_layers[stage]).items():
                assert torch.isfinite(v).all(), (stage, k)
                assert (v - ref.params[k]).abs().max().item() <= 1e-5, (stage, k)


# a clip threshold between the runs' norms (about 0.31 to 0.37): some steps keep their updates, others redo them;
# chimera at D = 2 with LAMB (a per-group step counter, which every stage's update must start from)
MIXED = {
    "1f1b-D2": MLP.with_flags(schedule="1f1b", stages=2, micro_batches=4, clip_grad=0.35),
    "chimera-D2-lamb": MLP.with_flags(schedule="chimera", stages=2, micro_batches=4, clip_grad=0.35, optimizer="lamb"),
    "chimera-D4": MLP.with_flags(schedule="chimera", stages=4, micro_batches=4, clip_grad=0.35),
}


@pytest.mark.parametrize("cfg", MIXED.values(), ids=MIXED.keys())
def test_kept_and_redone_steps_match_the_drained_step_bit_for_bit(cfg):
    """Steps whose norm stays under the clip keep their per-stage updates, steps that clip roll them back and redo
    them: either way every parameter, loss and norm is bitwise the drained step's (the flag off), and the run is
    sequential training's."""
    job = compile_job(cfg)
    got = run_local(job, return_state=True)
    drained = run_local(compile_job(cfg.with_flags(post_validate=False)), return_state=True)
    outcomes = [m["update"] for m in got.metrics]
    assert {"kept", "redone"} <= set(outcomes), outcomes
    # a step whose predecessor was redone ran twice (it began on the optimistic weights), and kept steps overlap
    assert any(m["repeated"] for m in got.metrics) and "update" not in drained.metrics[0]
    for m, d in zip(got.metrics, drained.metrics):
        assert (m["loss"], m["grad_norm"]) == (d["loss"], d["grad_norm"]), m["step"]
    mine, theirs = _states(got), _states(drained)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(t, theirs[k]) for k, t in mine.items()), [k for k, t in mine.items()
                                                                     if not torch.equal(t, theirs[k])]
    assert_reference(job, got)


def test_unclipped_steps_keep_every_update():
    """A clip no norm reaches: every step keeps its optimistic updates; sequential training's result."""
    job = compile_job(MLP.with_flags(schedule="1f1b", stages=2, micro_batches=2, data_parallel=2, clip_grad=1e9,
                                     steps=3))
    res = run_local(job, return_state=True)
    assert [m["update"] for m in res.metrics] == ["kept"] * 3
    assert_reference(job, res)


INF = {
    "1f1b-D2-W2": MLP.with_flags(chain="tests.postval_chain:mlp_inf", schedule="1f1b", stages=2, micro_batches=2,
                                 data_parallel=2, clip_grad=0.35),
    "chimera-D2-noclip": MLP.with_flags(chain="tests.postval_chain:mlp_inf", schedule="chimera", stages=2,
                                        micro_batches=4, clip_grad=0.0),
}


@pytest.mark.parametrize("cfg", INF.values(), ids=INF.keys())
def test_non_finite_step_is_skipped(cfg):
    """An infinite input in one micro-batch of step 2 makes its gradients NaN (the loss stays finite): the
    validation rolls every stage's update back, so the weights and AdamW's moments are those before the step, and
    training goes on as sequential training that skips the step."""
    job = compile_job(cfg)
    res = run_local(job, return_state=True)
    outcomes = [m["update"] for m in res.metrics]
    assert outcomes[POISONED[0]] == "skipped" and outcomes.count("skipped") == 1, outcomes
    assert math.isnan(res.metrics[POISONED[0]]["grad_norm"])
    assert_reference(job, res)


def test_lowering_splits_the_optimizer_step():
    """Every worker: one STAGE_UPDATE per stage replica it holds, right after the replica's gradient-sum wait (or,
    without one, before the waits), and VALIDATE last instead of the optimizer step; the rest of its list is the
    drained lowering's."""
    for sched in (build_schedule("chimera", 4, 4), build_schedule("1f1b", 2, 4, data_parallel=2),
                  build_schedule("1f1b", 2, 4)):
        drained = lower(sched)
        post = validate(post_validate(drained))
        for w, (old, new) in enumerate(zip(drained.actions, post.actions)):
            assert [a for a in new if a.kind not in (Kind.STAGE_UPDATE, Kind.VALIDATE)] == list(old[:-1])
            assert old[-1].kind is Kind.OPTIMIZER_STEP and new[-1].kind is Kind.VALIDATE
            updates = [(a.pipe, a.stage) for a in new if a.kind is Kind.STAGE_UPDATE]
            assert sorted(updates) == sorted(sched.stages_of(w))
            for i, a in enumerate(new):
                if a.kind is Kind.ALLREDUCE_WAIT:
                    assert new[i + 1] == type(a)(Kind.STAGE_UPDATE, a.pipe, a.stage)
            last_compute = max(i for i, a in enumerate(new) if a.kind.is_compute)
            assert all(i > last_compute for i, a in enumerate(new) if a.kind is Kind.STAGE_UPDATE)
    with pytest.raises(ValueError, match="one optimizer step"):
        post_validate(post_validate(lower(build_schedule("1f1b", 2, 2))))


def test_flag_off_keeps_the_drained_lowering_and_flag_on_reaches_the_job():
    off = compile_job(MLP.with_flags(schedule="chimera", stages=2, micro_batches=4, post_validate=False))
    on = compile_job(MLP.with_flags(schedule="chimera", stages=2, micro_batches=4))
    assert off.schedule.actions == lower(off.schedule.compute_only()).actions
    assert on.schedule.actions == post_validate(off.schedule).actions
    assert (off.run.post_validate, on.run.post_validate) == (False, True)


@pytest.mark.parametrize("flags,msg", [({"offload": "optimizer"}, "--post-validate does not combine with --offload"),
                                       ({"shard_optimizer": True, "data_parallel": 2},
                                        "--post-validate does not combine with --shard-optimizer")])
def test_refused_combinations_name_the_flags(flags, msg):
    with pytest.raises(ConfigError, match=msg):
        compile_job(MLP.with_flags(schedule="1f1b", stages=2, micro_batches=2, **flags))


def test_simulator_prices_stage_updates():
    """The stage updates cost the ``stage_update`` field (per stage), the validation nothing; the overlapped steps
    simulator runs the post-validated lists."""
    lowered = post_validate(lower(build_schedule("1f1b", 2, 4)))
    free = simulate_steps(lowered, Costs(fwd=1, bwd=2), steps=3)
    priced = simulate_steps(lowered, Costs(fwd=1, bwd=2, extra=(("stage_update", 5),)), steps=3)
    assert priced.makespan > free.makespan
    assert Costs(extra=(("stage_update", [3, 4]),)).of(lowered.actions[1][-2]) == 4  # worker 1: stage 1's update


def test_memory_model_and_ledger_count_the_rollback_copies():
    """Each stage update keeps its replica's weights and optimizer state until the next step's first update takes
    the step's verdict, and the step's gradients are set aside until then (the rollback copies): the memory model
    prices them from the kinds table's STAGE_UPDATE row and the runtime's ledger measures them, in a step that
    carries its predecessor's (step 2, every step kept, so none drains). On bert-tiny they are the peak; a budget
    between the drained and the post-validated peak is refused with --post-validate only, naming it."""
    from chimera.compile.memory import BudgetError
    from chimera.compile.model import preset_chain
    from chimera.plan.memory import worker_memory
    from chimera.profile.layers import profile_chain
    from chimera.profile.shapes import shapes_profile

    cfg = TrainConfig.from_flags(model="bert-tiny", micro_batch_size=2, seq_len=16, steps=3, optimizer="adamw",
                                 corpus="synthetic", profile_memory=True, partition="uniform", p2p="gloo",
                                 schedule="chimera", stages=2, micro_batches=4, post_validate=True, threads=1,
                                 clip_grad=0)
    prof = profile_chain(preset_chain(cfg), [2], reps=1, warmup=0, threads=1)
    peaks = {}
    for pv in (True, False):
        job = compile_job(cfg.with_flags(post_validate=pv))
        run = run_local(job)
        assert not pv or [m["update"] for m in run.metrics] == ["kept"] * 3
        measured = run.metrics[-1]["memory_peak_bytes"]  # step 2: step 1's copies carry AdamW's moments
        modelled = worker_memory(prof, job.schedule, job.stage_layers, job.unit_size, "adamw", False)
        for w, (m, mm) in enumerate(zip(measured, modelled)):
            assert abs(mm.total / m["total"] - 1) <= 0.08, (pv, w, m, mm)
            if pv:  # at the peak, before the step's first update: the previous step's copy of every replica (its
                # weights and both AdamW moments, a 4-byte step apart) and its gradients, and a sum in progress
                assert mm.sync == m["sync"] > 0 and abs(mm.total / m["total"] - 1) <= 0.001, (w, m, mm)
                assert mm.rollback == mm.params + mm.optimizer + mm.grads, mm
                assert abs(m["rollback"] - mm.rollback) <= 0.01 * mm.rollback, (w, m, mm)
            else:
                assert m["rollback"] == 0 and mm.rollback == 0, (m, mm)
        peaks[pv] = (max(m["total"] for m in measured), max(
            w.total for w in worker_memory(shapes_profile(job.chain, job.unit_size), job.schedule, job.stage_layers,
                                           job.unit_size, "adamw", False)))
    assert peaks[True][0] > 1.5 * peaks[False][0], peaks  # the copies move the peak, measured and modelled
    assert peaks[True][1] > 1.5 * peaks[False][1], peaks
    budget = (peaks[True][1] + peaks[False][1]) // 2
    compile_job(cfg.with_flags(post_validate=False, memory_per_worker=str(budget)))
    with pytest.raises(BudgetError, match="rollback copies .*no --post-validate") as refused:
        compile_job(cfg.with_flags(memory_per_worker=str(budget)))
    assert "--recompute" not in str(refused.value)  # no activations at that peak: recomputing would not help


def test_planned_partition_counts_the_copies_and_times_the_drained_step():
    """``plan_partition(post_validated=True)``: the rollback copies in every worker's memory (so a limit that the
    drained step fits may not fit), the step simulated as the drained one."""
    from chimera.plan.partition import plan_partition
    from chimera.profile import synthetic

    prof = synthetic.profile([synthetic.layer(i, 1e-3, 4 << 20, 1 << 16, 1 << 12, [2]) for i in range(8)], [2])
    sched = build_schedule("chimera", 4, 4)
    drained = plan_partition(prof, sched, 2, False, "adamw")
    post = plan_partition(prof, sched, 2, False, "adamw", post_validated=True)
    assert post.step_s == drained.step_s and post.sizes == drained.sizes
    for d, p in zip(drained.memory, post.memory):
        # the previous step's copies and gradients, carried until the step's first update
        assert d.rollback == 0 and p.rollback == p.params + p.optimizer + p.grads > 0, (d, p)
        assert p.total > d.total
    limited = plan_partition(prof, sched, 2, False, "adamw", memory_limit=drained.peak_memory, post_validated=True)
    assert limited.peak_memory > drained.peak_memory  # nothing fits it: the least memory, over the limit


def test_planner_prices_the_rollback_copies():
    """``plan(post_validated=True)`` (``chimera plan --post-validate``, profiled ``auto``): every candidate's peak
    counts its stage updates' rollback copies (the step is the drained one's), so a limit that the drained plan fits
    with room to spare may fit nothing, and no candidate is offloaded; the bounds stay sound (the pruned ranking
    equals the reference's)."""
    from chimera.plan import plan
    from chimera.profile import synthetic

    sizes, mib = [1, 2, 4], 1 << 20
    prof = synthetic.profile([synthetic.layer(i, 1e-3, 16 * mib, mib, 1 << 16, sizes) for i in range(8)], sizes)
    free = {pv: plan(prof, 8, 32, None, "adamw", post_validated=pv) for pv in (False, True)}
    for d, p in zip(free[False].ranked, free[True].ranked):
        assert d.candidate == p.candidate and d.step_s == p.step_s  # the same steps: a post-validated step drains
        assert p.peak_memory > d.peak_memory, (d, p)
        if d.candidate.stages == 8:  # a layer per worker: 16 MiB weights, 32 MiB AdamW state, 16 MiB gradients, and
            assert p.peak_memory >= 128 * mib, p  # the previous step's copies of all three until the first update
    drained = plan(prof, 8, 32, 100 * mib, "adamw")
    assert drained.ranked and drained.ranked[0].peak_memory <= 85 * mib
    none = plan(prof, 8, 32, 100 * mib, "adamw", post_validated=True)
    assert none.ranked == [] and all(e.reason for e in none.infeasible)
    pruned = plan(prof, 8, 32, 140 * mib, "adamw", post_validated=True)
    reference = plan(prof, 8, 32, 140 * mib, "adamw", post_validated=True, prune=False)
    assert pruned.inputs["post_validate"] is True and pruned.ranked
    assert [(e.candidate, e.step_s, e.peak_memory) for e in pruned.ranked] == \
        [(e.candidate, e.step_s, e.peak_memory) for e in reference.ranked[:len(pruned.ranked)]]
    assert all(e.peak_memory <= 140 * mib and e.candidate.stages == 8 and not e.candidate.offload.optimizer
               for e in pruned.ranked)
    with pytest.raises(ValueError, match="give --offload none or drop --post-validate"):
        plan(prof, 8, 32, None, "adamw", post_validated=True, fixed={"offload": "optimizer"})
    with pytest.raises(ValueError, match="--post-validate with --shard-optimizer"):
        plan(prof, 8, 32, None, "adamw", post_validated=True, optimizer_owned=lambda sched, layers: [{}])
    # the bound's memory ceiling (a candidate under it is not walked) holds the copies too
    from chimera.offload.lowering import lower as lower_all
    from chimera.plan.memory import memory_ceiling, worker_memory

    sched, layers = build_schedule("chimera", 4, 4), [[0, 1], [2, 3], [4, 5], [6, 7]]
    peak = max(m.total for m in worker_memory(prof, lower_all(sched, None, True), layers, 1, "adamw", False))
    assert memory_ceiling(prof, sched, layers, 1, "adamw") < peak <= memory_ceiling(prof, sched, layers, 1, "adamw",
                                                                                     post_validated=True)


def test_a_checkpoint_mid_run_holds_validated_weights(tmp_path):
    """A checkpoint step takes its own verdict before it is saved (the next step has not begun): resuming from it
    continues bit for bit as the run that went on, though that step was rolled back and redone."""
    cfg = MIXED["chimera-D2-lamb"].with_flags(steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    job = compile_job(cfg)
    full = run_local(job, return_state=True)
    assert full.metrics[2]["update"] == "redone", [m["update"] for m in full.metrics]  # the checkpointed step
    resumed = run_local(compile_job(cfg.with_flags(checkpoint_dir=None, checkpoint_every=0,
                                                   resume=str(tmp_path / "step-00000003"))), return_state=True)
    assert [m["step"] for m in resumed.metrics] == [3, 4, 5]
    assert [(m["loss"], m["grad_norm"], m["update"]) for m in resumed.metrics] == \
        [(m["loss"], m["grad_norm"], m["update"]) for m in full.metrics[3:]]
    mine, theirs = _states(resumed), _states(full)
    assert mine.keys() == theirs.keys() and all(torch.equal(t, theirs[k]) for k, t in mine.items())


@pytest.mark.ray
def test_post_validated_steps_on_ray_hold_each_record_until_its_verdict(ray_session):
    """Under Ray the driver queues steps on the actors; a step's record waits for the verdict its next step takes
    (kept, redone, skipped) and comes out in step order with its norm, as sequential training gives them. Steps
    stopped short of the run's end take their last verdict by draining, and so does a step run alone."""
    from ray_launch.driver import RayJob

    cfg = MIXED["chimera-D2-lamb"]
    job = compile_job(cfg)
    with RayJob(job) as ray_job:
        records = list(ray_job.steps(range(3), ahead=1, per_call=2))
        records += [ray_job.step(s) for s in range(3, cfg.training.steps)]
    ref = train_sequential(job)
    assert [r["step"] for r in records] == list(range(cfg.training.steps))
    assert {"kept", "redone"} <= {r["update"] for r in records} <= {"kept", "redone"}
    assert not any("_verdicts" in r for r in records)
    for r, loss, norm in zip(records, ref.losses, ref.grad_norms):
        assert abs(r["loss"] - loss) <= 1e-6 and abs(r["grad_norm"] - norm) <= 1e-5 * max(1.0, norm), r


def test_post_validated_steps_overlap_in_simulation():
    """The steps simulator: a worker's first stage update of step j waits for every worker's VALIDATE of step j-1
    and for nothing else at the boundary, so a post-validated ZB-H2 (D = 4, N = 8, F = I = W) repeats at least as
    often as with no global check at all (its stages update one by one), sooner than drained steps (the next step's forwards start under the last weight
    gradients)."""
    from chimera.schedule.steps import boundaries, period, repeat

    sched = post_validate(lower(build_schedule("zb-h2", 4, 8)))
    rows = repeat(sched, 2).actions
    base = [0]
    for row in rows:
        base.append(base[-1] + len(row))
    validates = {base[w] + i for w, row in enumerate(rows) for i, a in enumerate(row[:len(row) // 2])
                 if a.kind is Kind.VALIDATE}
    gates = boundaries(sched, 2, overlap=True)
    for w, row in enumerate(rows):
        half = len(row) // 2
        first = next(i for i, a in enumerate(row[half:]) if a.kind is Kind.STAGE_UPDATE) + half
        assert validates <= set(gates[base[w] + first]), w
    costs = Costs(fwd=1, bwd=1, wgrad=1, optimizer=1, extra=(("stage_update", 0.5),))
    checked = period(sched, costs, 5, overlap=True).period
    unchecked = period(lower(build_schedule("zb-h2", 4, 8)), costs, 5, overlap=True).period
    drained = period(lower(build_schedule("zb-h2", 4, 8)), costs, 5, overlap=False).period
    assert checked <= unchecked < drained, (checked, unchecked, drained)

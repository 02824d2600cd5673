"""The planner's pruning (``plan(..., prune=True)``: candidates in the order of their lower bound, the rest skipped
past the ``top + refine``-th estimate; schedules from the build cache, equal contents priced once) keeps the
answer of the reference path (``prune=False``: every candidate built afresh and estimated)."""

import dataclasses
import gc
import random

import pytest

from chimera.plan import plan
from chimera.plan.bound import frame_key, lower_bound
from chimera.plan.memory import _front, _front_scan, memory_ceiling
from chimera.plan.partition import balanced, layers_of
from chimera.plan.search import _frame, _key, candidates
from chimera.profile import Link
from chimera.profile.synthetic import layer, profile

pytestmark = pytest.mark.timeout(120)

SIZES = (1, 2, 4)


def _profile(offload: bool):  # type: ignore[no-untyped-def]
    """Ten uneven layers (a heavy middle), links priced; with host copies priced where offload is asked for."""
    layers = [layer(i, 0.004 + 0.003 * (i % 3), 2_000_000 + 600_000 * i, 900_000, 40_000, SIZES) for i in range(10)]
    p = profile(layers, SIZES)
    return dataclasses.replace(p, host_in=Link(1e-5, 1e9), host_out=Link(1e-5, 1e9)) if offload else p


def _row(e):  # type: ignore[no-untyped-def]
    return (e.candidate, e.step_s, e.exact, e.bubble, e.peak_memory, e.partition, e.samples_per_s)


@pytest.mark.parametrize("limit", [None, 40_000_000])
def test_the_pruned_plan_is_the_reference_plan(limit):
    """A limit that only recomputing or offloaded candidates meet, and none: some candidates are pruned, and the
    top list (every figure) and every figure estimated are the reference's."""
    p = _profile(offload=limit is not None)
    args = {"workers": 8, "global_batch": 32, "memory_limit": limit, "top": 4, "refine": 2}
    fast, ref = plan(p, **args), plan(p, **args, prune=False)
    assert fast.pruned > 0 and ref.pruned == 0
    assert [_row(e) for e in fast.ranked[:4]] == [_row(e) for e in ref.ranked[:4]]
    everything = {e.candidate: _row(e) for e in ref.ranked}
    assert all(everything[e.candidate] == _row(e) for e in fast.ranked)


@pytest.mark.parametrize("limit", [None, 40_000_000])
def test_the_bound_is_below_every_estimate(limit):
    """Every first-pass estimate of a candidate (as it is, recomputing, offloaded, per-stage offload) is at least
    its lower bound: what makes skipping a candidate whose bound is past the kept estimates safe. The memory
    ceiling the bound picks its form by is at least the peak of the candidate as it is."""
    p = _profile(offload=limit is not None)
    ref = plan(p, 8, global_batch=32, memory_limit=limit, refine=0, prune=False)  # no refinement: first-pass figures
    frames: dict = {}
    bound, ceiling = {}, {}
    for c, why in candidates(len(p.layers), 8, 32, sorted(SIZES), frames):
        if why is None:
            f, k = _frame(c, frames), (_key(c), c.unit)
            bound[k] = lower_bound(p, f, c.unit, not (c.split_backward or c.spec.split_only), limit, "adamw", True)
            ceiling[k] = memory_ceiling(p, f, layers_of(balanced(p, f, c.unit, False)), c.unit, "adamw")
    as_is = [e for e in ref.ranked if not e.candidate.recompute and not e.candidate.offload.optimizer]
    assert as_is or limit is not None  # under the limit none fits as it is
    assert all(ceiling[(_key(e.candidate), e.candidate.unit)] >= e.peak_memory for e in as_is)
    assert len(ref.ranked) > 20 and any(e.candidate.recompute for e in ref.ranked) == (limit is not None)
    ratios = []
    for e in ref.ranked:
        b = bound[(_key(e.candidate), e.candidate.unit)]
        assert b <= e.step_s, (e.candidate.label, e.candidate.flags(), b, e.step_s)
        ratios.append(b / e.step_s)
    assert max(ratios) > 0.7, max(ratios)  # the bound is not trivially low


def test_the_bound_key_names_every_field_the_bound_reads():
    """Candidates share a bound where their frames' keys are equal: a frame changed in any field a schedule
    compares by (its actions aside: a frame has none) gets another key, and frames of equal content the same."""
    frames: dict = {}
    c = next(c for c, why in candidates(10, 8, 32, sorted(SIZES), frames) if why is None and c.stages == 4)
    f = _frame(c, frames)
    other = {"stages": f.stages + 1, "microbatches": f.microbatches * 2, "data_parallel": f.data_parallel + 1,
             "placement": {**f.placement, next(iter(f.placement)): f.workers - 1},
             "microbatch_scale": f.microbatch_scale / 2, "lowered": not f.lowered}
    compared = {fl.name for fl in dataclasses.fields(f) if fl.compare} - {"actions"}
    assert compared == set(other)  # a new field of Schedule must join the key (and this list)
    for name, value in other.items():
        assert frame_key(dataclasses.replace(f, **{name: value})) != frame_key(f), name
    assert frame_key(dataclasses.replace(f, actions=[()] * (f.workers + 1))) != frame_key(f)  # more workers
    assert frame_key(dataclasses.replace(f, name="another")) == frame_key(f)


def test_the_two_count_front_is_the_scanned_front():
    """The memory walk's sweep over states of one or two stash counts keeps what the pairwise scan keeps, in the
    same order (ties in sum and in either count included)."""
    rng = random.Random(7)
    for n in (1, 2):
        for _ in range(300):
            lives = list({tuple(rng.randrange(6) for _ in range(n)) for _ in range(rng.randrange(1, 30))})
            rng.shuffle(lives)
            ordered = sorted(lives, key=sum, reverse=True)
            assert _front(ordered) == _front_scan(ordered)


def test_planning_leaves_the_collector_as_it_was(monkeypatch):
    """The planner pauses the cyclic collector and moves what survived to its oldest generation: afterwards the
    collector runs again, nothing stays frozen, and a freeze someone else holds is left alone (neither undone nor
    redone: its objects may still die by their reference counts, e.g. a cached schedule the build cache drops,
    so the frozen count is no witness)."""
    p = _profile(offload=False)
    assert gc.isenabled()
    plan(p, 8, global_batch=32)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    real_unfreeze = gc.unfreeze
    gc.freeze()
    try:
        calls: list[str] = []
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        plan(p, 8, global_batch=32)
        assert gc.isenabled() and calls == [] and gc.get_freeze_count() > 0
    finally:
        monkeypatch.undo()
        real_unfreeze()

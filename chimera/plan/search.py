"""The planner: enumerate configurations, prune, partition, simulate, rank.

For K workers and a global batch G it considers every schedule the runtime runs (GPipe and the candidates of
``--schedule auto``, :func:`chimera.schedule.best.candidates`: 1F1B, interleaved with two chunks per worker,
Chimera in its three modes, each with a whole and a split backward, ZB-H1, ZB-H2, BitPipe, four-pipe
Chimera), every depth D dividing K (W = K / D), every profiled
micro-batch size B with N = G / (B W) micro-batches, and recomputation where memory asks for it. A candidate the
runtime cannot run, or whose best partition does not fit the memory limit, is kept with the reason; one that does
not fit is tried again recomputing, then with the optimizer state, the gradients and the weights in host memory
(offload, its swaps priced with the profile's host <-> device copy), and one that fits only with offload also
with the least offload per stage that fits (the heaviest stages offloaded first). The others
are partitioned (``chimera.plan.partition``) and simulated with the profile's costs, in the order of their lower
bound (:mod:`chimera.plan.bound`); those whose bound is past the ``top + refine`` fastest estimates are not (the
top list stays that of ``prune=False``, which estimates every candidate)::

    result = plan(profile, workers=8, global_batch=64, memory_limit=80 * GiB)
    result.ranked[0].candidate.flags()       # {"schedule": "chimera", "stages": 4, ...}
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chimera.offload.policy import EVERYTHING, Offload, ladder
from chimera.plan.bound import bound_and_fit, frame_key
from chimera.plan.candidate import Candidate, Evaluated, PlanResult
from chimera.plan.collector import collector_paused
from chimera.plan.fit import fit_offload
from chimera.plan.partition import PartitionResult, layers_of, plan_partition, with_memory
from chimera.plan.sharding import Owned, sharding
from chimera.profile import Profile
from chimera.schedule import Schedule, ScheduleConfigError, build_schedule
from chimera.schedule.registry import cached_build, frame_schedule, fresh_builds
from chimera.schedule.registry import candidates as registry_candidates


def schedules(stages: int, microbatches: int) -> list[tuple[str, str, int, bool]]:
    """(schedule, Chimera mode, chunks, split backward) of every schedule of the registry that builds for (D, N)
    (:func:`chimera.schedule.registry.candidates`)."""
    return [(spec.name, o.get("mode", "direct"), o.get("chunks", 2), o.get("split_backward", False))
            for _, spec, o in registry_candidates(stages, microbatches, auto_only=False)]


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def candidates(num_layers: int, workers: int, global_batch: int, sizes: Sequence[int],
               frames: dict[tuple[Any, ...], Schedule] | None = None, stages: int | None = None,
               shard_optimizer: bool = False) -> Iterator[tuple[Candidate, str | None]]:
    """Every (candidate, reason it cannot run or None) without recomputation, at depth ``stages`` if given;
    ``frames`` keeps their frames (:func:`chimera.schedule.registry.frame_schedule`)."""
    frames = {} if frames is None else frames
    for d in [stages] if stages else _divisors(workers):
        w = workers // d
        for b in sizes:
            if global_batch % (b * w):
                continue  # this B cannot make the global batch at this width
            n = global_batch // (b * w)
            # one stage: every schedule is the same
            for name, mode, chunks, split in schedules(d, n) if d > 1 else [("1f1b", "direct", 2, False)]:
                c = Candidate(name, mode, d, w, b, n, False, chunks, split_backward=split,
                              shard_optimizer=shard_optimizer)
                yield c, _why_not(c, num_layers, sizes, frames)


def _key(c: Candidate) -> tuple[Any, ...]:
    return (c.schedule, c.stages, c.micro_batches, c.mode, c.chunks, c.data_parallel, c.split_backward)


def _frame(c: Candidate, frames: dict[tuple[Any, ...], Schedule]) -> Schedule:
    key = _key(c)
    if key not in frames:
        frames[key] = frame_schedule(c.schedule, c.stages, c.micro_batches, chunks=c.chunks, mode=c.mode,
                                     data_parallel=c.data_parallel, split_backward=c.split_backward)
    return frames[key]


def _why_not(c: Candidate, num_layers: int, sizes: Sequence[int], frames: dict[tuple[Any, ...], Schedule]
             ) -> str | None:
    if c.parts > num_layers:
        return f"{c.parts} stages > {num_layers} layers"
    try:  # what the builder refuses; its order is paid for when the candidate is evaluated
        _frame(c, frames)
    except ScheduleConfigError as e:
        return str(e)
    if c.mode == "halving" and c.micro_batch_size % 2:
        return f"halving splits micro-batches in two: B = {c.micro_batch_size} is odd"
    if c.mode == "halving" and c.unit not in sizes:
        return f"halving runs half micro-batches of {c.unit}, a size the profile lacks"
    return None


def plan(profile: Profile, workers: int, global_batch: int | None = None, memory_limit: int | None = None,
         optimizer: str = "adamw", top: int = 10, exchange: bool | None = None, refine: int = 3,
         stages: int | None = None, fixed: Mapping[str, Any] | None = None, prune: bool = True,
         optimizer_owned: Owned | None = None, clip: bool = False, post_validated: bool = False) -> PlanResult:
    """Rank the configurations of ``profile``'s model on ``workers`` workers (module docstring).

    Every candidate is first estimated with its load-balanced partition (the compute-only schedule plus the
    largest gradient sum and the optimizer step); the best ``refine`` then get their partition refined and their
    step simulated on the lowered schedule (``chimera.plan.partition``), until the first ``refine`` of the ranking
    are all refined, and the list is ranked again (``Evaluated.exact`` tells the two apart); equal steps keep the
    order of enumeration. ``stages`` fixes D (and so W = workers / D); ``fixed``: training flags
    (``Candidate.flags`` names) every candidate must have, e.g.
    ``{"micro_batches": 8, "schedule": "chimera"}``. ``exchange``: whether a pair of replicas sums gradients by
    exchange (gloo; default: unless the profile was taken on a GPU).

    ``prune``: candidates are estimated in the order of their lower bound (:mod:`chimera.plan.bound`), and the rest
    skipped (``PlanResult.pruned``) once a bound exceeds the ``top + refine``-th fastest estimate: the first
    ``top`` of ``ranked`` are then those of the reference path, ``prune=False``, which estimates every candidate
    and builds every schedule afresh (slow at scale; what the tests compare with).

    ``optimizer_owned`` (``--shard-optimizer``, ZeRO-1; :func:`chimera.compile.shard.owned_pricer` makes it from the
    model): per schedule and partition, each worker's owned parameter bytes per stage, as training assigns them;
    every candidate is then priced with only its owned share of the optimizer state (one that cannot be sharded is
    infeasible, with the reason) and none with offload, which sharding does not allow. ``clip``: training clips by
    the global gradient norm (``--clip-grad`` > 0, its default), which every optimizer step then pays.
    ``post_validated`` (``--post-validate``): every candidate's memory counts the rollback copies of its stage
    updates, and none is offloaded (no offload combines with it); its step is the drained one's
    (:func:`plan_partition`)."""
    fixed = dict(fixed or {})
    shard = sharding(optimizer_owned, fixed)
    if post_validated and shard:
        raise ValueError("--post-validate with --shard-optimizer: post-validated steps keep every stage's whole "
                         "optimizer state on each replica; drop one")
    if post_validated and fixed.get("offload", "none") != "none":
        raise ValueError(f"--post-validate with --offload {fixed['offload']}: post-validated steps keep every "
                         "stage's optimizer state on the device; give --offload none or drop --post-validate")
    if exchange is None:
        exchange = not profile.device.startswith("cuda")
    stages = fixed.get("stages", stages)
    if stages is not None and (stages < 1 or workers % stages):
        raise ValueError(f"--stages {stages} must divide --workers {workers}")
    sizes = sorted(profile.micro_batch_sizes)
    g = global_batch or max(sizes) * workers
    result = PlanResult([], [], inputs={"workers": workers, "global_batch": g, "memory_limit": memory_limit,
                                        "optimizer": optimizer, "shard_optimizer": shard,
                                        "post_validate": post_validated})
    pending = []
    frames: dict[tuple[Any, ...], Schedule] = {}
    # by what the bound reads (frame_key), unit and backward form: the bound, and whether it surely fits as it is
    bounds: dict[tuple[Any, ...], tuple[float, bool]] = {}
    for i, (c, why) in enumerate(candidates(len(profile.layers), workers, g, sizes, frames, stages, shard)):
        if not _matches(c, fixed, ("recompute", "offload")):
            continue
        if why:
            result.infeasible.append(Evaluated(c, reason=why))
            continue
        bound, fits = 0.0, False
        if prune:
            frame, whole = _frame(c, frames), not (c.split_backward or c.spec.split_only)
            key = (frame_key(frame), c.unit, whole)
            if key not in bounds:
                bounds[key] = bound_and_fit(profile, frame, c.unit, whole, memory_limit, optimizer, exchange,
                                            post_validated)
            bound, fits = bounds[key]
        pending.append((bound, i, c, fits))
    pending.sort(key=lambda x: x[:2])
    pricer = _Pricer(profile, memory_limit, optimizer, exchange, prune, optimizer_owned, clip, post_validated)
    with collector_paused(), contextlib.nullcontext() if prune else fresh_builds():
        order = _estimate(pricer, pending, result, fixed, top + refine)
        _price_deferred(pricer, result, order, top + refine, refine)
        _refine(pricer, result, order, refine)
    return result


def _estimate(pricer: _Pricer, pending: Sequence[tuple[float, int, Candidate, bool]], result: PlanResult,
              fixed: Mapping[str, Any], keep: int) -> dict[Candidate, tuple[int, int]]:
    """The first pass over ``pending`` (bound, index, candidate), fewest bound first, into ``result``; returns
    every ranked candidate's place in the enumeration (what breaks ties). With ``prune``, stops at the first
    bound above the ``keep``-th fastest estimate so far (every later one's bound is as high). A candidate that
    surely fits as it is is estimated without its memory (``peak_memory`` None, :func:`_price_deferred`), and
    pruned if its estimate is past that cut (``PlanResult.pruned`` counts both)."""
    best: list[float] = []  # max-heap (negated) of the ``keep`` fastest estimates so far
    order: dict[Candidate, tuple[int, int]] = {}
    for k, (bound, i, c, fits) in enumerate(pending):
        cut = -best[0] if pricer.prune and len(best) >= keep else None
        if cut is not None and bound > cut:
            result.pruned += len(pending) - k
            break
        try:
            sched = pricer.schedule(c)
        except ScheduleConfigError as e:
            result.infeasible.append(Evaluated(c, reason=str(e)))
            continue
        # one that surely fits as it is is estimated once (no recomputing or offloaded variant, which, estimated on
        # its lowered schedule, could be faster), so past the cut it is never in the top ``keep``
        ev = _first_fit(pricer, c, sched, result.infeasible, fixed, memory=not fits)
        if fits and cut is not None and ev.reason is None and ev.step_s > cut:  # type: ignore[operator]
            result.pruned += 1
            continue
        if ev.reason is not None:
            result.infeasible.append(ev)
            continue
        for j, fit in enumerate([ev, *_per_stage(pricer, ev, sched)]):
            if not _matches(fit.candidate, fixed, ()):
                result.infeasible.append(dataclasses.replace(fit, reason="not what the fixed flags ask for"))
                continue
            result.ranked.append(fit)
            order[fit.candidate] = (i, j)
            heapq.heappush(best, -fit.step_s)  # type: ignore[operator]
            if len(best) > keep:
                heapq.heappop(best)
    return order


def _price_deferred(pricer: _Pricer, result: PlanResult, order: Mapping[Candidate, tuple[int, int]], keep: int,
                    refine: int) -> None:
    """The first estimates left without memory (``peak_memory`` None) priced where they show: after the ``refine``
    fastest (which :func:`_refine` prices again) up to the ``keep``-th; those past it are pruned (never in the
    top: the refined ones move, the others keep their order)."""
    result.ranked.sort(key=_rank(order))
    kept = []
    for pos, e in enumerate(result.ranked):
        if e.peak_memory is None and pos >= keep:
            result.pruned += 1
            continue
        if e.peak_memory is None and pos >= refine:
            e = pricer.evaluate(e.candidate, pricer.schedule(e.candidate), rounds=0, exact=False)
            if e.reason is not None:
                result.infeasible.append(e)
                continue
        kept.append(e)
    result.ranked = kept


def _rank(order: Mapping[Candidate, tuple[int, int]]) -> Any:
    """The ranking key: the step, then the place in the enumeration."""

    def rank(e: Evaluated) -> tuple[float, tuple[int, int]]:
        return e.step_s, order[e.candidate]  # type: ignore[return-value]

    return rank


def _refine(pricer: _Pricer, result: PlanResult, order: Mapping[Candidate, tuple[int, int]], refine: int) -> None:
    """The ``refine`` fastest estimates again with their partition searched on the lowered schedule; ranks. Until
    the first ``refine`` of the ranking are all exact: a refined step counts what the estimate leaves out (the
    messages' and sums' worker time, the optimizer's wait for the slowest stage), so it may rank behind estimates
    that have yet to pay theirs, and a plan must not be chosen on an estimate."""
    rank = _rank(order)
    result.ranked.sort(key=rank)
    while True:
        todo = [k for k, e in enumerate(result.ranked[:refine]) if not e.exact]
        if not todo:
            return
        head = {k: pricer.evaluate(result.ranked[k].candidate, pricer.schedule(result.ranked[k].candidate), rounds=4)
                for k in todo}
        result.infeasible += [h for h in head.values() if h.reason is not None]
        result.ranked = [head.get(k, e) for k, e in enumerate(result.ranked)]
        result.ranked = [e for e in result.ranked if e.reason is None]
        result.ranked.sort(key=rank)


def _matches(c: Candidate, fixed: Mapping[str, Any], skip: tuple[str, ...]) -> bool:
    """Whether candidate ``c`` has every fixed flag (those in ``skip`` are not decided yet)."""
    flags = c.flags()
    return all(flags[k] == v for k, v in fixed.items() if k not in skip and k in flags)


def _first_fit(pricer: _Pricer, c: Candidate, sched: Schedule, tried: list[Evaluated], fixed: Mapping[str, Any],
               memory: bool = True) -> Evaluated:
    """``c`` estimated as it is; if it does not fit, recomputing, then with ever more of its state in host memory
    (offload); the configurations that did not fit go to ``tried``. Returns the first that fits, else the last
    tried (with its reason). ``memory`` False: a candidate that surely fits, estimated without its memory."""
    ev = pricer.evaluate(c, sched, rounds=0, exact=False, memory=memory)
    if ev.reason is not None and "memory" in ev.reason and not c.recompute:
        tried.append(ev)
        ev = pricer.evaluate(dataclasses.replace(c, recompute=True), sched, rounds=0, exact=False)
    no_offload = pricer.owned is not None or pricer.post_validated
    offloads = [] if no_offload else _offloads(c, max(1, len(pricer.profile.layers) // c.parts), fixed)
    for off in offloads:  # sharded or post-validated: no offload (it moves the optimizer state, whole)
        if ev.reason is None or "memory" not in ev.reason:
            break
        tried.append(ev)
        ev = pricer.evaluate(dataclasses.replace(ev.candidate, offload=off), sched, rounds=0, exact=False)
    return ev


def _offloads(c: Candidate, layers_per_stage: int, fixed: Mapping[str, Any]) -> list[Offload]:
    """The offload policies tried, least first, for a candidate that does not fit: every level of the ladder above
    none, then the weights swapped in just before use (prefetch 0), then, with a whole backward, in packs of fewer
    and fewer layers; only the ladder, with them, where ``fixed`` gives the prefetch depth or the pack size."""
    if "prefetch" in fixed or "offload_pack" in fixed:
        return [Offload.uniform(lv, fixed.get("prefetch", 1), fixed.get("offload_pack", 0)) for lv in ladder()[1:]]
    out = [Offload.uniform(lv) for lv in ladder()[1:]] + [Offload.uniform(EVERYTHING, prefetch=0)]
    if not c.split_backward:
        out += [Offload.uniform(EVERYTHING, pack=k) for k in range(layers_per_stage - 1, 0, -1)]
    return out


@dataclass
class _Pricer:
    """What the evaluations of one plan share: the profile and limits, the schedules built, and the partitions
    priced so far by schedule content (Chimera's halving is doubling's order on half units, priced alike:
    the same actions and placement, units whose costs the scale multiplies and divides exactly when it is a power
    of two). ``prune``: the optimised path (schedules from the build cache, equal contents priced once); else the
    reference (every schedule built afresh, every candidate priced)."""

    profile: Profile
    memory_limit: int | None
    optimizer: str
    exchange: bool
    prune: bool
    owned: Owned | None = None  # --shard-optimizer: each worker's owned parameter bytes per stage
    clip: bool = False  # the optimizer step clips by the global gradient norm
    post_validated: bool = False  # --post-validate: the stage updates' rollback copies count, no offload
    built: dict[tuple[Any, ...], Schedule] = field(default_factory=dict)
    priced: dict[tuple[Any, ...], list[tuple[Any, PartitionResult]]] = field(default_factory=dict)

    def schedule(self, c: Candidate) -> Schedule:
        """``c``'s schedule, built once per plan."""
        key = _key(c)
        if key not in self.built:
            build = cached_build if self.prune else build_schedule
            self.built[key] = build(c.schedule, c.stages, c.micro_batches, chunks=c.chunks, mode=c.mode,
                                    data_parallel=c.data_parallel, split_backward=c.split_backward)
        return self.built[key]

    def partition(self, c: Candidate, sched: Schedule, rounds: int, exact: bool, memory: bool = True
                  ) -> PartitionResult:
        """:func:`plan_partition` of ``c`` on ``sched``; once per content of the schedule with ``prune``
        (``memory`` False: without the memory)."""
        scale = sched.microbatch_scale
        binary = scale.numerator & (scale.numerator - 1) == 0 and scale.denominator & (scale.denominator - 1) == 0
        key = (tuple(sched.placement.items()), sched.data_parallel, sched.microbatches, None if binary else scale,
               tuple(map(len, sched.actions)), c.unit, c.recompute, c.offload, rounds, exact, self.clip,
               self.post_validated)
        same = self.priced.setdefault(key, []) if self.prune else []
        for k, (actions, part) in enumerate(same):
            if actions == sched.actions:  # rows shared by builds of one order compare by identity
                if memory and not part.memory:  # estimated without its memory: priced now, the step kept
                    part = with_memory(part, self.profile, sched, c.unit, c.recompute, self.optimizer, self.exchange,
                                       c.offload, self.owned, self.post_validated)
                    same[k] = (actions, part)
                return part
        part = plan_partition(self.profile, sched, c.unit, c.recompute, self.optimizer, self.memory_limit,
                              self.exchange, rounds=rounds, exact=exact, offload=c.offload, owned=self.owned,
                              memory=memory, clip=self.clip, post_validated=self.post_validated)
        same.append((sched.actions, part))
        return part

    def evaluate(self, c: Candidate, sched: Schedule, rounds: int = 8, exact: bool = True,
                 memory: bool = True) -> Evaluated:
        """``c`` priced on ``sched``, or why it does not fit (or, sharded, cannot be sharded); ``memory`` False (a
        candidate that surely fits): its ``peak_memory`` None, not priced."""
        try:
            part = self.partition(c, sched, rounds, exact, memory)
        except ValueError as e:  # the optimizer state cannot be sharded so (chimera.compile.shard)
            if self.owned is None:
                raise
            return Evaluated(c, reason=str(e))
        peak, limit = part.peak_memory, self.memory_limit
        if limit is not None and peak > limit:
            return Evaluated(c, peak_memory=peak, partition=part.sizes,
                             reason=f"needs {peak / 2**30:.2f} GiB on a worker, more than the {limit / 2**30:.2f} "
                                    "GiB memory limit")
        samples = c.micro_batch_size * c.micro_batches * c.data_parallel
        return Evaluated(c, part.step_s, samples / part.step_s if part.step_s else None, part.bubble,
                         peak if memory else None, part.sizes, exact=exact)


def _per_stage(pricer: _Pricer, ev: Evaluated, sched: Schedule) -> list[Evaluated]:
    """A candidate that fits only with offload, again with the least offload per stage that fits on its partition
    (heaviest stages offloaded first; :func:`fit_offload`), when that differs from offloading every stage; [] if
    it does not, or does not fit once its partition is searched again."""
    c, limit = ev.candidate, pricer.memory_limit
    if limit is None or not c.offload.optimizer or not c.offload.uniform_level or ev.partition is None:
        return []
    first = c.offload.stages[0]
    top = first.level
    upto = [lv for lv in ladder() if lv.amount <= top.amount]
    off, _, _ = fit_offload(pricer.profile, sched.compute_only(), layers_of(ev.partition), c.unit, pricer.optimizer,
                            c.recompute, limit, [Offload.uniform(lv, first.prefetch, first.pack) for lv in upto],
                            exchange=pricer.exchange, per_stage=True)
    if off.text == c.offload.text:
        return []
    mixed = pricer.evaluate(dataclasses.replace(c, offload=off), sched, rounds=0, exact=False)
    return [mixed] if mixed.reason is None else []

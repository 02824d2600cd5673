"""Simulator costs of a configuration from a profile: per-stage compute, messages, gradient sums.

    costs = simulator_costs(profile, stage_layers, unit=4, recompute=False, schedule=sched)
    simulate(sched, costs).makespan          # predicted step time, seconds

A stage's forward is the sum of its layers' forwards at the schedule's unit size (the micro-batch size, or half
of it under backward halving); its backward the sum of their backwards, plus their forward again where the
stage recomputes (every stage but the last: the runtime keeps the last stage's graph); of that backward, the
profiled weight-gradient part is what a split backward's W costs and the rest what its I costs (a whole B
costs both, as profiled). A message costs the
profiled p2p link for the bytes the sending stage outputs; a stage's gradient sum the profiled allreduce over
its group for its parameter bytes, less the parameters tied to another stage: those are summed in the optimizer
step over every rank holding either end (the runtime's tied-weight sum), which the step's cost includes (with,
on CPU, the adds of a worker's own ends and the copy of the sum back). A swap
(offload) costs the profiled host <-> device copy of the stage's parameter bytes (free when the profile has no
copy measurement); on GPU swap-ins run beside compute (a copy stream). On CPU (gloo), communication also takes
the workers' own time: every send and receive the link's fixed cost, a gradient sum's packing and unpacking
copies (:func:`_host_busy`). Where training clips by the global gradient norm (``clip``), the optimizer step
also pays its passes over the gradients and its allreduce (:func:`_clip_s`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from chimera.offload.costs import exposed_copy_s, packs_of
from chimera.offload.policy import Offload
from chimera.profile import CommProfile, Link, Profile, ProfileError
from chimera.schedule import Costs, Schedule

#: copy passes of adding one buffer into another in place (read two, write one) and writing the result back
SUM_COPIES = 2.5
#: copy passes of clipping by the global gradient norm: a read for the norms, a read and a write for the scaling
CLIP_COPIES = 1.5


@dataclass(frozen=True)
class StageCosts:
    """Per stage: forward, backward and (of that backward) weight-gradient seconds for one unit, output bytes,
    parameter bytes."""

    fwd: list[float]
    bwd: list[float]
    out_bytes: list[int]
    param_bytes: list[int]
    tied_bytes: list[int]  # parameters tied to a layer of another stage (summed apart, in the optimizer step)
    wgrad: list[float]


def stage_costs(profile: Profile, stage_layers: Sequence[Sequence[int]], unit: int, recompute: bool) -> StageCosts:
    """Costs of every stage of a partition at ``unit`` samples per schedule unit."""
    last = len(stage_layers) - 1
    fwd, bwd, out, params, tied, wgrad = [], [], [], [], [], []
    for s, layers in enumerate(stage_layers):
        t = profile.stage_seconds(layers, unit)
        fwd.append(t["forward"])
        bwd.append(t["backward"] + (t["recompute"] if recompute and s < last else 0.0))
        wgrad.append(min(t["backward_weight"], t["backward"]))
        out.append(profile.cost(layers[-1], unit).output_bytes)
        shared = sum(b for _, b in profile.tied_within(layers))  # a tied pair within: one parameter
        params.append(sum(profile.layers[i].param_bytes for i in layers) - shared)
        tied.append(profile.tied_apart(layers))
    return StageCosts(fwd, bwd, out, params, tied, wgrad)


def simulator_costs(profile: Profile, stage_layers: Sequence[Sequence[int]], unit: int, recompute: bool,
                    schedule: Schedule, optimizer: str | None = None, offload: Offload | None = None,
                    clip: bool = False) -> Costs:
    """The :class:`~chimera.schedule.Costs` of running ``schedule`` with this partition (module docstring).

    The simulator's compute costs are per micro-batch and scaled by the schedule's ``microbatch_scale``, so under
    backward halving (units of B/2) the cost of a unit is given times two. Without a communication profile
    messages and gradient sums are free (a lower bound). ``offload`` with packs: a packed stage's forward and
    backward include its pack swaps (:func:`_packed`). As the runtime splits a backward, the first stage's I is
    empty and its W its whole backward (``Costs.first_stage_whole_backward``). ``clip`` (training's
    ``--clip-grad`` > 0): the optimizer step also clips by the global gradient norm (:func:`_clip_s`).
    """
    sc = stage_costs(profile, stage_layers, unit, recompute)
    if offload is not None and offload.weights and profile.host_in is not None:
        _packed(profile, stage_layers, sc, offload, recompute, profile.device.startswith("cuda"))
    optimizer_s, stage_opt = 0.0, [0.0] * len(stage_layers)
    if optimizer is not None:  # every worker steps its stages' parameters; the step ends with the slowest
        stage_opt = [_optimizer_s(profile, layers, optimizer) for layers in stage_layers]
        optimizer_s = max(sum(stage_opt[s] for _, s in schedule.stages_of(w)) for w in range(schedule.workers))
        if clip:
            optimizer_s += _clip_s(profile, sc, schedule)
    per_mb = float(1 / schedule.microbatch_scale)
    fwd, wgrad = [t * per_mb for t in sc.fwd], [t * per_mb for t in sc.wgrad]
    bwd = [t * per_mb - w for t, w in zip(sc.bwd, wgrad)]  # the input-gradient part: B costs bwd + wgrad
    swap_in = [profile.host_in.time(b) for b in sc.param_bytes] if profile.host_in else 0.0
    swap_out = [profile.host_out.time(b) for b in sc.param_bytes] if profile.host_out else 0.0
    # a post-validated lowering's STAGE_UPDATE: the stage's own share of the optimizer step
    base = Costs(fwd=fwd, bwd=bwd, wgrad=wgrad, optimizer=optimizer_s, swap_in=swap_in, swap_out=swap_out,
                 copy_overlap=profile.device.startswith("cuda"), extra=(("stage_update", tuple(stage_opt)),))
    if profile.comm is not None:
        base = _with_comm(base, profile, profile.comm, stage_layers, sc, schedule)
    if profile.actions:  # the runtime's own time per action (chimera profile --comm local measures it)
        base = replace(base, fixed=tuple(sorted(profile.actions.items())))
    if profile.step_s:  # and per step
        base = per_step(base, profile.step_s, schedule)
    return base.first_stage_whole_backward(len(stage_layers))


def _optimizer_s(profile: Profile, layers: Sequence[int], optimizer: str) -> float:
    """One optimizer step over ``layers``' parameters: their layers' profiled steps, less a tied parameter's share
    of its later end where both ends are here (one parameter: bert-tiny's tied embedding counted twice had priced a
    one-stage worker's LAMB step at 10.0 ms, which measured 6.2)."""
    t = sum(profile.layers[i].optimizer_s.get(optimizer, 0.0) for i in layers)
    for i, nbytes in profile.tied_within(layers):
        lp = profile.layers[i]
        t -= lp.optimizer_s.get(optimizer, 0.0) * nbytes / max(1, lp.param_bytes)
    return t


def per_step(costs: Costs, step_s: float, schedule: Schedule) -> Costs:
    """``costs`` with ``step_s`` more per step: what a step pays once beyond its actions
    (:func:`chimera.calibrate.step_remainder`), on the optimizer step of a drained lowering, or spread over each
    worker's stage updates of a post-validated one (a lowered schedule has one or the other)."""
    if not step_s:
        return costs
    per_worker = len(schedule.stages_of(0))
    update = costs.field_value("stage_update")
    spread = tuple(costs.stage_value(update, s) + step_s / per_worker for s in range(schedule.stages))
    extra = tuple((k, v) for k, v in costs.extra if k != "stage_update") + (("stage_update", spread),)
    return replace(costs, optimizer=costs.optimizer + step_s, extra=extra)


def _with_comm(base: Costs, profile: Profile, comm: CommProfile, stage_layers: Sequence[Sequence[int]],
               sc: StageCosts, schedule: Schedule) -> Costs:
    """``base`` with the measured links priced: messages, each stage's replica gradient sum, and one synchronous
    sum of the tied parameters over every rank holding either end (added to the optimizer step)."""
    copy = _host_copy(profile, comm)
    allreduce = []
    for s in range(len(stage_layers)):
        n = schedule.stage_group_size(s)
        bucket = sc.param_bytes[s] - sc.tied_bytes[s]
        allreduce.append(_sum_s(profile, comm, copy, n, bucket) if n > 1 and bucket > 0 else 0.0)
    optimizer_s = base.optimizer
    tied_stages = [s for s, b in enumerate(sc.tied_bytes) if b]
    if tied_stages:
        ranks = {r for s in tied_stages for r in schedule.stage_group(s)}
        optimizer_s += _sum_s(profile, comm, copy, len(ranks), max(sc.tied_bytes))
        if copy is not None:  # a worker holding k ends adds k - 1 into the first and copies the sum back
            ends = max(sum(s in tied_stages for _, s in schedule.stages_of(w)) for w in range(schedule.workers))
            optimizer_s += SUM_COPIES * (ends - 1) * copy.time(max(sc.tied_bytes))
    groups = [schedule.stage_group_size(s) for s in range(len(stage_layers))]
    busy = _host_busy(copy, comm, sc, allreduce, groups) if copy is not None else {}
    return replace(base, p2p_latency=comm.p2p.latency_s, p2p_bytes=sc.out_bytes, p2p_bandwidth=comm.p2p.bandwidth_Bps,
                   allreduce=allreduce, optimizer=optimizer_s, **busy)


def _sum_s(profile: Profile, comm: CommProfile, copy: Link | None, ranks: int, nbytes: int) -> float:
    """A gradient sum of ``nbytes`` over ``ranks`` ranks. Two ranks on the workers' own cores (gloo on CPU)
    exchange their buffers as one p2p message each way and add (``GradBuckets``' exchange, the runtime's tied
    sum): the p2p link's time for the bytes plus one copy for the add; else the measured allreduce."""
    if copy is not None and ranks == 2:
        return comm.p2p.time(nbytes) + copy.time(nbytes)
    return _allreduce_link(profile, ranks).time(nbytes)


def _clip_s(profile: Profile, sc: StageCosts, schedule: Schedule) -> float:
    """Clipping by the global gradient norm in a worker's optimizer step: on CPU its passes over the gradients of
    the stages it holds (:data:`CLIP_COPIES` host copies of their bytes; on a GPU device kernels, left out), and on
    every device the norm's allreduce over all ranks (one number: the measured link's latency)."""
    t = 0.0
    if not profile.device.startswith("cuda") and profile.host_out is not None:
        t += max(CLIP_COPIES * profile.host_out.time(sum(sc.param_bytes[s] for _, s in schedule.stages_of(w)))
                 for w in range(schedule.workers))
    ranks = schedule.workers * schedule.data_parallel
    if profile.comm is not None and profile.comm.allreduce and ranks > 1:
        t += _allreduce_link(profile, ranks).latency_s
    return t


def _host_copy(profile: Profile, comm: CommProfile) -> Link | None:
    """Where communication runs on the workers' own cores (gloo on CPU), the cold copy between two host tensors
    that packs and unpacks gradient sums; None on GPU, where the copies are device kernels."""
    if comm.backend != "gloo" or not profile.device.startswith("cpu"):
        return None
    return profile.host_out


def _host_busy(copy: Link, comm: CommProfile, sc: StageCosts, allreduce: list[float], groups: list[int]
               ) -> dict[str, object]:
    """Worker time of communication on the workers' own cores: each send and receive the link's fixed cost (the
    process posts and completes it), a gradient sum's start one copy of its bucket (packing) plus that fixed
    cost, its wait two and a half (adding the peer's bucket, unpacking). A stage of two replicas sums by an
    exchange (:class:`chimera.runtime.grad_sync.GradBuckets`), whose start also sends the bucket from the worker's
    own thread (into the shared-memory ring, or gloo's socket, which takes what its buffer holds at once): priced
    as the p2p link's time for the bucket (1.9 MB: 0.79 ms measured to post a gloo send on the 2-core development
    machine, where the fixed cost alone priced 0.05). NCCL posts asynchronously: none there."""
    buckets = [b - t for b, t in zip(sc.param_bytes, sc.tied_bytes)]
    start = [copy.time(b) + (comm.p2p.time(b) if n == 2 else comm.p2p.latency_s) if a else 0.0
             for b, a, n in zip(buckets, allreduce, groups)]
    wait = [SUM_COPIES * copy.time(b) if a else 0.0 for b, a in zip(buckets, allreduce)]
    return {"p2p_busy": comm.p2p.latency_s, "sync_start": start, "sync_wait": wait}


def _packed(profile: Profile, stage_layers: Sequence[Sequence[int]], sc: StageCosts, offload: Offload,
            recompute: bool, overlap: bool) -> None:
    """Add their pack copies (:func:`chimera.offload.costs.exposed_copy_s`) to the forward and backward of every
    stage whose weights move in packs. A recomputing backward streams the packs twice (its forward again)."""
    assert profile.host_in is not None
    last = len(stage_layers) - 1
    for s, layers in enumerate(stage_layers):
        if not offload.packed_at(s):
            continue
        times = [profile.host_in.time(sum(profile.layers[i].param_bytes for i in pack))
                 for pack in packs_of(layers, offload.at(s).pack)]
        again = 2 if recompute and s < last else 1
        sc.bwd[s] += again * exposed_copy_s(times, sc.bwd[s] / again, overlap)
        sc.fwd[s] += exposed_copy_s(times, sc.fwd[s], overlap)


def _allreduce_link(profile: Profile, ranks: int):  # type: ignore[no-untyped-def]
    """The allreduce model for ``ranks`` ranks: measured, else the nearest measured group size above or below."""
    assert profile.comm is not None
    measured = profile.comm.allreduce
    if ranks in measured:
        return measured[ranks]
    if not measured:
        raise ProfileError("the profile's communication part has no allreduce measurement; profile with --comm")
    nearest = min(measured, key=lambda n: (abs(n - ranks), -n))
    return measured[nearest]

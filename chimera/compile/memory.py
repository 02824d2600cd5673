"""The memory pass: one verdict on whether a configuration fits a worker, and with which offload.

    budget = budget_of(cfg, world)                       # --memory-per-worker, else what a worker has
    verdict = memory_verdict(cfg, model, decision, stage_layers, budget)   # ConfigError naming the bytes
    verdict.offload, verdict.lowered                     # the per-stage policy, the schedule lowered with it

The memory model prices the configuration on the chain's shapes (the meta device: nothing is allocated) at the
schedule's unit size, on the partition it runs. With ``--memory-per-worker`` that is the budget the runtime also
enforces, and ``--offload auto`` takes the least offload per stage that fits it; without it the configuration is
refused only when it cannot fit the memory a worker has (the GPU's free memory, or this machine's shared by the
workers). ``--schedule auto`` marks its candidates with the same pricing (:func:`exclude_over_budget`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chimera.config import ConfigError, TrainConfig
from chimera.job import OptimizerShards
from chimera.offload.lowering import lower
from chimera.offload.policy import EVERYTHING, Offload, ladder
from chimera.plan.fit import OverBudget, available_memory, fit_offload, levers
from chimera.plan.memory import WorkerMemory, worker_memory
from chimera.profile import Profile
from chimera.profile.shapes import shapes_profile
from chimera.schedule import Schedule
from chimera.schedule.best import Choice, exclude
from chimera.util.units import GiB, format_bytes, parse_bytes


class BudgetError(ConfigError):
    """The configuration does not fit ``--memory-per-worker``; ``least``: the fewest bytes it needs at its peak
    worker with any offload tried."""

    def __init__(self, message: str, least: int) -> None:
        super().__init__(message)
        self.least = least


@dataclass(frozen=True)
class Budget:
    """Bytes a worker may hold (None: unknown), where that figure comes from, and whether the runtime enforces it
    (given by ``--memory-per-worker``)."""

    bytes: int | None
    source: str
    enforced: bool


@dataclass(frozen=True)
class MemoryVerdict:
    """The offload policy of every stage, the schedule lowered with it, the largest worker's peak, why."""

    offload: Offload
    lowered: Schedule
    peak: WorkerMemory | None
    why: str | None = None


class Shapes:
    """The chain's per-layer bytes at each unit size, made once per compile (the meta device allocates nothing)."""

    def __init__(self, chain: Any) -> None:
        self.chain = chain
        self.by_unit: dict[int, Profile] = {}

    def at(self, unit: int) -> Profile:
        if unit not in self.by_unit:
            self.by_unit[unit] = shapes_profile(self.chain, unit)
        return self.by_unit[unit]


def budget_of(cfg: TrainConfig, world: int) -> Budget:
    """``--memory-per-worker`` (bytes, or ``device``: what a worker has), else what a worker has, unenforced."""
    text, device = cfg.memory.memory_per_worker, cfg.training.device
    if text is not None and text != "device":
        try:
            return Budget(parse_bytes(text), f"--memory-per-worker {text}", True)
        except ValueError as e:
            raise ConfigError(f"--memory-per-worker: {e}") from None
    have = available_memory(device, world)
    if text == "device":
        if have is None:
            raise ConfigError("--memory-per-worker device: no GPU is visible here to read its memory from; give the "
                              "budget in bytes (e.g. 70GiB)")
        return Budget(have[0], f"--memory-per-worker device ({have[1]})", True)
    return Budget(have[0], have[1], False) if have else Budget(None, "unknown", False)


def _configured(cfg: TrainConfig, stages: int, split: bool = False, most_layers: int = 1) -> list[Offload]:
    """The offload policies to try, least first: the configured one, or (``auto``) every level of the ladder, then,
    for the weights, a shallower prefetch and packs of fewer and fewer layers, unless the user fixed them
    (``--prefetch``, ``--offload-pack``; packs only with a whole backward, ``split`` False)."""
    m = cfg.memory
    if m.offload == "auto":
        out = [Offload.uniform(lv, m.prefetch, m.offload_pack) for lv in ladder()]
        if "prefetch" not in cfg.given and m.prefetch > 0 and not m.offload_pack:
            out.append(Offload.uniform(EVERYTHING, 0, 0))
        if "offload_pack" not in cfg.given and not split:
            out += [Offload.uniform(EVERYTHING, m.prefetch, k) for k in range(most_layers - 1, 0, -1)]
        return out
    try:
        off = Offload.parse(m.offload, m.prefetch, m.offload_pack)
        off.check(stages)
    except ValueError as e:
        raise ConfigError(f"--offload {m.offload}: {e}") from None
    return [off]


def memory_verdict(cfg: TrainConfig, chain: Any, schedule: Schedule, stage_layers: list[list[int]], unit: int,
                   budget: Budget, shapes: Shapes, shards: OptimizerShards | None = None) -> MemoryVerdict:
    """The offload and lowered schedule of a configuration that fits; ConfigError naming the bytes it needs, by
    category, against the budget, and what to change when it does not (module docstring). ``shards``: the optimizer
    state is sharded (``--shard-optimizer``), each worker priced with its share."""
    t, m = cfg.training, cfg.memory
    split = schedule.splits_backward
    if m.offload_pack and split:
        raise ConfigError(f"--offload-pack {m.offload_pack} streams a stage's weights through one backward, but a "
                          "split backward (I, then W later) needs them twice: drop --offload-pack or --split-backward")
    offloads = _configured(cfg, schedule.stages, split, max(len(x) for x in stage_layers))
    pv = _post_validated(cfg, offloads)
    offloads = offloads[:1] if pv else offloads
    exchange = t.device == "cpu"
    owned = shards.per_worker(schedule) if shards is not None else None
    if budget.enforced:
        assert budget.bytes is not None
        try:
            off, lowered, mem = fit_offload(shapes.at(unit), schedule, stage_layers, unit, t.optimizer, t.recompute,
                                            budget.bytes, offloads, exchange=exchange, per_stage=m.offload == "auto",
                                            optimizer_owned=owned, post_validated=pv)
        except OverBudget as e:
            raise BudgetError(f"--memory-per-worker {m.memory_per_worker}: {e}", e.least) from None
        except ValueError as e:
            raise ConfigError(f"--memory-per-worker {m.memory_per_worker}: {e}") from None
        peak = max(mem, key=lambda w: w.total)
        return MemoryVerdict(off, lowered, peak, _auto_why(off, peak, budget.bytes, m.prefetch) if m.offload == "auto"
                             else None)
    off = offloads[0]
    lowered = lower(schedule, off, pv)
    if budget.bytes is None:
        return MemoryVerdict(off, lowered, None)
    mem = worker_memory(shapes.at(unit), lowered, stage_layers, unit, t.optimizer, t.recompute, exchange, offload=off,
                        optimizer_owned=owned)
    worst = max(range(len(mem)), key=lambda w: mem[w].total)
    peak = mem[worst]
    if peak.total > budget.bytes:
        what = ("--post-validate" if pv and peak.rollback > peak.activations
                else f"--micro-batch-size {cfg.schedule.micro_batch_size}")
        raise BudgetError(
            f"{what} cannot fit: the memory model estimates "
            f"{peak.total / GiB:.2f} GiB at worker {worst}'s peak (parameters {peak.params / GiB:.2f}, optimizer "
            f"{peak.optimizer / GiB:.2f}, gradients {peak.grads / GiB:.2f}, activations {peak.activations / GiB:.2f}, "
            f"messages {peak.messages / GiB:.2f}, gradient sums {peak.sync / GiB:.2f}, rollback copies "
            f"{peak.rollback / GiB:.2f} GiB) but a worker has "
            f"{budget.bytes / GiB:.2f} GiB ({budget.source}); change: "
            f"{''.join(f'{x}, ' for x in levers(peak, t.recompute, pv, off))}more --stages, or set "
            "--memory-per-worker", peak.total)
    return MemoryVerdict(off, lowered, peak)


def _post_validated(cfg: TrainConfig, offloads: Sequence[Offload]) -> bool:
    """Whether the steps are post-validated (``--post-validate``); ConfigError where the configuration cannot be:
    the optimizer state offloaded or sharded (``--offload auto`` then keeps everything on the device)."""
    t = cfg.training
    if not t.post_validate:
        return False
    if offloads[0].optimizer:
        raise ConfigError(f"--post-validate does not combine with --offload {cfg.memory.offload} yet; drop one")
    if t.shard_optimizer:
        raise ConfigError("--post-validate does not combine with --shard-optimizer yet; drop one")
    return True


def _auto_why(off: Offload, peak: WorkerMemory, budget: int, prefetch: int) -> str:
    """``--offload auto``'s decision line: the policy of every stage (pack size or prefetch depth included), its peak
    against the budget, and why the weights move as they do."""
    why = f"offload auto: {off.describe()}; {peak.total} bytes at the largest worker's peak, budget {budget}"
    moving = off.moving  # every stage whose weights move does so alike
    if moving and moving.packed:
        why += "; whole-stage swaps do not fit"
    elif moving and moving.prefetch < prefetch:
        why += f"; --prefetch {prefetch} does not fit"
    return why


def exclude_over_budget(cfg: TrainConfig, ranked: Sequence[Choice], split: Callable[[int], list[list[int]]],
                        budget: Budget, shapes: Shapes,
                        owned: Callable[[Schedule], Sequence[Mapping[int, int]] | None] | None = None,
                        by: str = "makespan") -> list[Choice]:
    """``--schedule auto``'s ranking with the candidates that cannot fit the budget marked, weights included, so that
    its first is the fastest that fits; each priced on ``split(stages)`` at its own unit size. With ``--offload
    auto`` a schedule that fits without offload beats a faster one that needs it, and so on up the ladder. When
    nothing fits, the ranking is returned unmarked and the memory verdict refuses the fastest, naming what to
    change. ``owned`` (``--shard-optimizer``): per candidate schedule, each worker's owned optimizer-state bytes
    per stage (``OptimizerShards.per_worker``), so that an extra replica costs its weights and gradients only; a
    ConfigError from it (the schedule cannot be sharded) marks the candidate. ``by``: what ``ranked`` is ranked by
    (``makespan`` or ``period``), kept."""
    if budget.bytes is None:
        return list(ranked)
    t, m = cfg.training, cfg.memory
    tries = _configured(cfg, cfg.schedule.stages) if budget.enforced else [None]
    tries = tries[:1] if t.post_validate else tries  # no offload combines with it (memory_verdict says so)
    for off in tries:
        over: dict[str, str] = {}
        for c in (c for c in ranked if c.fits):
            if m.offload_pack and c.options.get("split_backward"):
                over[c.label] = "--offload-pack needs a whole backward"
                continue
            sched = c.schedule
            assert sched is not None
            unit = int(cfg.schedule.micro_batch_size * sched.microbatch_scale)
            try:
                own = owned(sched) if owned is not None else None
                mem = worker_memory(shapes.at(unit), lower(sched, off, t.post_validate), split(sched.stages), unit,
                                    t.optimizer, t.recompute, t.device != "cuda", offload=off, optimizer_owned=own)
            except ValueError as e:
                over[c.label] = str(e)
                continue
            need = max(w.total for w in mem)
            if need <= budget.bytes:
                return exclude(ranked, over, by)
            with_off = f" with --offload {off.text}" if off is not None and off.optimizer else ""
            over[c.label] = f"needs {format_bytes(need)} of {format_bytes(budget.bytes)}{with_off}"
    return list(ranked)

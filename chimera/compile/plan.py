"""The plan pass (``--plan FILE|auto``): the planner's choice of schedule, D, W, B, N, recomputation, offload and
partition, applied to the request before anything else is decided.

``--plan FILE`` trains the plan a ``chimera plan`` run wrote (a flag the user gave that contradicts it is refused);
``--plan auto`` profiles the model briefly and plans for ``--stages x --data-parallel`` workers and the global batch
``N x B x W``, keeping every field the user fixed (``TrainConfig.given``: D, N, W, B, schedule, mode...) and
choosing the rest::

    cfg, prediction, why = apply_plan(cfg, chain, threads=1, log=print)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chimera.compile.shard import owned_pricer
from chimera.config import FIELDS, ConfigError, TrainConfig
from chimera.job import Prediction
from chimera.plan import PlanError, PlanFile, plan
from chimera.plan.profiles import cached_profile, sharing
from chimera.profile import ProfileError
from chimera.schedule.registry import get as schedule_spec
from chimera.util.units import parse_bytes

#: the flags a plan decides (the planner's Candidate.flags, plus the partition)
PLANNED = ("schedule", "mode", "stages", "data_parallel", "micro_batch_size", "micro_batches", "recompute", "chunks",
           "offload", "prefetch", "offload_pack", "split_backward", "partition", "shard_optimizer")


def _fixed(cfg: TrainConfig) -> dict[str, Any]:
    """The planned flags the user set, with the schedule's canonical name."""
    out = {k: cfg.value(k) for k in PLANNED if k in cfg.given and k != "partition"}
    if "schedule" in out:
        if out["schedule"] == "auto":
            del out["schedule"]
        else:
            out["schedule"] = schedule_spec(out["schedule"]).name
    return out


def _apply(cfg: TrainConfig, flags: dict[str, Any]) -> TrainConfig:
    """``cfg`` with the plan's flags (decisions, not marked as given by the user)."""
    given = cfg.given
    return TrainConfig(**{k: getattr(cfg.with_flags(**flags), k) for k in ("model", "schedule", "training", "memory",
                                                                             "profiling", "checkpoint")}, given=given)


def apply_plan(cfg: TrainConfig, chain: Any, threads: int, log: Callable[[str], None] | None = None
               ) -> tuple[TrainConfig, Prediction | None, str | None]:
    """``cfg`` with its plan applied, the plan's prediction and a line saying what was planned (module docstring);
    ``cfg`` unchanged without ``--plan``."""
    spec = cfg.schedule.plan
    if spec is None:
        return cfg, None, None
    try:
        chosen = _from_file(cfg, spec, chain) if spec != "auto" else _auto(cfg, chain, threads, log)
    except (PlanError, ProfileError, ValueError) as e:
        raise ConfigError(f"--plan {spec}: {e}") from None
    flags = {k: v for k, v in chosen.flags.items() if k in FIELDS}
    kept = sorted(_fixed(cfg))
    trust = chosen.trust_for(cfg.training.clip_grad, cfg.training.post_validate)
    why = (f"plan {spec}: {chosen.flags['schedule']}, D={chosen.flags['stages']}, W={chosen.flags['data_parallel']}, "
           f"B={chosen.flags['micro_batch_size']}, N={chosen.flags['micro_batches']}"
           + (f" (kept as given: {', '.join(kept)})" if kept else "")
           + f"; predicted {chosen.predicted_step_s:.4g} s/step" + (f" (trust: {trust})" if trust else ""))
    prediction = Prediction(chosen.predicted_step_s, f"plan {spec}", chosen.predicted_bubble,
                            chosen.peak_memory_bytes, trust)
    return _apply(cfg, flags), prediction, why


def _from_file(cfg: TrainConfig, path: str, chain: Any) -> PlanFile:
    chosen = PlanFile.load(path)
    chosen.check_model(chain)
    clash = [f"--{k.replace('_', '-')} {v} (the plan has {chosen.flags[k]})" for k, v in _fixed(cfg).items()
             if k in chosen.flags and chosen.flags[k] != v]
    if clash:
        raise PlanError(f"the plan decides {', '.join(clash)}: drop those flags, or plan with them fixed (--plan auto "
                        "keeps what you give)")
    return chosen


def _auto(cfg: TrainConfig, chain: Any, threads: int, log: Callable[[str], None] | None) -> PlanFile:
    s, t = cfg.schedule, cfg.training
    workers = s.stages * s.data_parallel
    global_batch = s.micro_batches * s.micro_batch_size * s.data_parallel
    fixed = _fixed(cfg)
    b = s.micro_batch_size
    sizes = [b] if "micro_batch_size" in fixed else sorted({x for x in (b // 2, b, 2 * b) if x >= 1})
    if s.mode == "halving" and b % 2 == 0:
        sizes = sorted({*sizes, b // 2})
    prof = cached_profile(chain, sizes, t.device, threads, sharing(workers, t.device), progress=log)
    limit = parse_bytes(cfg.memory.memory_per_worker) if cfg.memory.memory_per_worker not in (None, "device") else None
    owned = owned_pricer(chain) if t.shard_optimizer else None  # sharded: priced as the job will be
    result = plan(prof, workers, global_batch, limit, t.optimizer, exchange=t.device != "cuda", fixed=fixed,
                  optimizer_owned=owned, clip=t.clip_grad > 0, post_validated=t.post_validate)
    return PlanFile.from_result(result, chain.name, prof.fingerprint, prof.device,
                                tokens_per_sample=chain.tokens_per_sample(), clip_grad=t.clip_grad,
                                post_validate=t.post_validate)

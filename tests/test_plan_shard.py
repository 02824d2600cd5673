"""``chimera plan --shard-optimizer``: the planner prices ZeRO-1 as training assigns it (each worker counts only the
optimizer state it owns), so a configuration that fits only sharded is planned, recorded and trained sharded."""

import dataclasses

import pytest

from chimera.compile import compile_job
from chimera.compile.model import preset_chain
from chimera.compile.shard import owned_pricer
from chimera.config import TrainConfig
from chimera.plan import PlanFile, plan
from chimera.profile import Timing
from chimera.profile.shapes import shapes_profile
from chimera.profile.synthetic import comm

pytestmark = pytest.mark.timeout(120)

BASE = TrainConfig.from_flags(model="bert-tiny", micro_batch_size=2, seq_len=16, steps=1, optimizer="adamw",
                              corpus="synthetic")
FIXED = {"stages": 4, "recompute": False, "schedule": "chimera"}  # two replicas of every stage


def _profile(chain):  # noqa: ANN001, ANN202
    """The model's exact bytes (its shapes), 1 ms per layer forward, input-gradient and weight-gradient part."""
    prof = shapes_profile(chain, 2)

    def t(s: float) -> Timing:
        return Timing(s, 0.0, 3)

    layers = [dataclasses.replace(lp, costs={2: dataclasses.replace(
        lp.costs[2], forward=t(1e-3), backward_input=t(1e-3), backward_weight=t(1e-3), backward=t(2e-3),
        recompute=t(1e-3))}) for lp in prof.layers]
    return dataclasses.replace(prof, layers=layers, comm=comm())


def test_a_configuration_that_fits_only_sharded_is_planned_with_the_flag(tmp_path):
    """Chimera's fastest configuration at D = 4 (two replicas of every stage): at a budget halfway between its
    sharded and unsharded peak it is first with --shard-optimizer and over the limit without; the plan file records
    the flag, and the job built from it shards the optimizer state."""
    chain = preset_chain(BASE)
    prof = _profile(chain)
    owned = owned_pricer(chain)
    free = {s: plan(prof, 4, 16, None, "adamw", fixed=FIXED, optimizer_owned=o) for s, o in ((False, None),
                                                                                          (True, owned))}
    best = free[False].ranked[0]
    assert best.candidate.schedule == "chimera", best.candidate.label
    sharded = next(e for e in free[True].ranked if e.candidate.label == best.candidate.label)
    assert sharded.peak_memory < best.peak_memory  # only the owned share of the optimizer state counts
    budget = (sharded.peak_memory + best.peak_memory) // 2

    with_flag = plan(prof, 4, 16, budget, "adamw", fixed=FIXED, optimizer_owned=owned)
    without = plan(prof, 4, 16, budget, "adamw", fixed=FIXED)
    assert with_flag.ranked[0].candidate.label == best.candidate.label
    assert with_flag.ranked[0].candidate.flags()["shard_optimizer"] is True
    assert best.candidate.label not in {e.candidate.label for e in without.ranked}
    assert any(e.candidate.label == best.candidate.label and "memory limit" in (e.reason or "")
               for e in without.infeasible)
    assert all("shard_optimizer" not in e.candidate.flags() for e in without.ranked)

    path = PlanFile.from_result(with_flag, chain.name, prof.fingerprint, prof.device).save(tmp_path / "p.json")
    assert PlanFile.load(path).flags["shard_optimizer"] is True
    job = compile_job(BASE.with_flags(plan=str(path)))
    assert job.shards is not None and job.shards.owners
    assert job.schedule.name.startswith("chimera")


def test_sharding_with_offload_is_refused():
    """As training refuses it: an offloaded stage keeps its whole optimizer state in the host store."""
    chain = preset_chain(BASE)
    with pytest.raises(ValueError, match="--offload none or drop --shard-optimizer"):
        plan(_profile(chain), 4, 16, None, "adamw", fixed={**FIXED, "offload": "optimizer"},
             optimizer_owned=owned_pricer(chain))


def test_a_schedule_that_cannot_be_sharded_is_infeasible_with_the_reason():
    """Too many data-parallel replicas for a stage's parameters: training refuses it, the plan marks it so."""
    chain = preset_chain(BASE)
    result = plan(_profile(chain), 64, 128, None, "adamw", fixed={"stages": 2, "schedule": "chimera"},
                  optimizer_owned=owned_pricer(chain))
    assert not result.ranked
    assert any("would own no parameter's optimizer state" in (e.reason or "") for e in result.infeasible)

"""Split backward (I + W) trains exactly what sequential training does: every new schedule at D in {2, 4},
N in {D, 2D}, with data parallelism, recomputation, tied weights (GPT-2), Chimera's two replicas and the four
of four-pipe Chimera; and every schedule ``auto`` or the planner can pick has a parity case at D = 2 and D = 4."""

import pytest
from test_runtime_parity import BASE, MODES, SGD, SGD_NORM, VARIANTS, assert_parity, mode_config
from test_runtime_parity import CASES as WHOLE

from chimera.config import TrainConfig
from chimera.schedule.registry import candidates
from chimera.schedule.registry import get as schedule_spec

#: a hang fails a test here within this many seconds (pytest-timeout), not at CI's limit
pytestmark = pytest.mark.timeout(180)

CASES = {
    "zb-h1-D2N2-W2": dict(schedule="zb-h1", stages=2, micro_batches=2, data_parallel=2, **SGD),
    "zb-h1-D4N8-gpt2": dict(schedule="zb-h1", stages=4, micro_batches=8, model="gpt2-tiny"),
    "zb-h2-D2N4-recompute": dict(schedule="zb-h2", stages=2, micro_batches=4, recompute=True),
    "zb-h2-D4N4-gpt2-W2": dict(schedule="zb-h2", stages=4, micro_batches=4, model="gpt2-tiny", data_parallel=2),
    "1f1b-split-D2N4-W2": dict(schedule="1f1b", split_backward=True, stages=2, micro_batches=4, data_parallel=2,
                               **SGD_NORM),
    "1f1b-split-D4N8-gpt2-recompute": dict(schedule="1f1b", split_backward=True, stages=4, micro_batches=8,
                                           model="gpt2-tiny", recompute=True, **SGD_NORM),
    "interleaved-split-D2N4-gpt2-W2": dict(schedule="interleaved", split_backward=True, stages=2, micro_batches=4,
                                           model="gpt2-tiny", data_parallel=2, **SGD_NORM),
    "interleaved-split-D4N8-gpt2": dict(schedule="interleaved", split_backward=True, stages=4, micro_batches=8,
                                        model="gpt2-tiny", model_overrides={"n_layer": 6}, **SGD_NORM),
    "chimera-split-D2N2-gpt2-W2": dict(schedule="chimera", split_backward=True, stages=2, micro_batches=2,
                                       model="gpt2-tiny", data_parallel=2, **SGD),
    "chimera-split-D4N4-recompute": dict(schedule="chimera", split_backward=True, stages=4, micro_batches=4,
                                         recompute=True, model="gpt2-tiny"),
    "chimera-split-D4N8-halving": dict(schedule="chimera", split_backward=True, stages=4, micro_batches=8,
                                       mode="halving"),
    "chimera-split-D2N4-halving-gpt2": dict(schedule="chimera", split_backward=True, stages=2, micro_batches=4,
                                            mode="halving", model="gpt2-tiny", **SGD_NORM),
    "chimera-split-D2N4-doubling-W2": dict(schedule="chimera", split_backward=True, stages=2, micro_batches=4,
                                           mode="doubling", data_parallel=2),
    "chimera-split-D4N8-doubling": dict(schedule="chimera", split_backward=True, stages=4, micro_batches=8,
                                        mode="doubling", **SGD_NORM),
    "zb-v-D2N4-gpt2-W2": dict(schedule="zb-v", stages=2, micro_batches=4, model="gpt2-tiny", data_parallel=2,
                              **SGD_NORM),
    "zb-v-D4N8-recompute": dict(schedule="zb-v", stages=4, micro_batches=8, recompute=True,
                                model_overrides={"num_hidden_layers": 6}),
    "bitpipe-D2N2-gpt2-W2": dict(schedule="bitpipe", stages=2, micro_batches=2, model="gpt2-tiny", data_parallel=2),
    "bitpipe-D4N8-recompute": dict(schedule="bitpipe", stages=4, micro_batches=8, recompute=True,
                                   model_overrides={"num_hidden_layers": 6}),
    "chimera4-D4N4-gpt2-W2": dict(schedule="chimera4", stages=4, micro_batches=4, model="gpt2-tiny", data_parallel=2),
    "chimera4-D4N8-recompute": dict(schedule="chimera4", stages=4, micro_batches=8, recompute=True, **SGD),
    "chimera-relisted-D4N4-gpt2": dict(schedule="chimera-relisted", stages=4, micro_batches=4, model="gpt2-tiny",
                                       **SGD_NORM),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", CASES.values(), ids=CASES.keys())
def test_split_backward_parity(flags):
    assert_parity(BASE.with_flags(steps=2, **flags))


def _label(cfg: TrainConfig) -> tuple[str, int]:
    """A parity case as what auto and the planner call the schedule (``1f1b --split-backward``), with its D."""
    s = cfg.schedule
    return schedule_spec(s.name).label({"mode": s.mode, "chunks": s.chunks, "split_backward": s.split_backward}), s.stages


def test_every_schedule_auto_or_the_planner_can_pick_has_a_parity_case():
    """Every variant of the registry's candidates (those ``--schedule auto`` tries and GPipe, which the planner adds)
    at D = 2 and D = 4, for N = D and N = 2D, is trained to parity by a case of this file or test_runtime_parity.
    Schedules registered from outside the package (tests/toy_extension.py, when test_extend ran first) carry their
    own parity test."""
    cases = [BASE.with_flags(model=m, schedule=s, stages=d, micro_batches=d * f) for s, d, f, m in WHOLE]
    cases += [*VARIANTS.values(), *(mode_config(*c) for c in MODES), *(BASE.with_flags(**f) for f in CASES.values())]
    covered = {_label(c) for c in cases}
    wanted = {(label, d) for d in (2, 4) for n in (d, 2 * d) for label, spec, _ in candidates(d, n, auto_only=False)
              if spec.build.__module__.startswith("chimera.")}
    assert wanted - covered == set(), f"no parity case trains {sorted(wanted - covered)}"

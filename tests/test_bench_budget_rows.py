"""bench/budget_rows.py's ``auto`` pick: ranked by the period of consecutive steps, as the rows are timed."""

from fractions import Fraction

import pytest

from bench.budget_rows import auto_choice, torch_need
from bench.workloads import WORKLOADS

pytestmark = pytest.mark.timeout(60)
UNITS = 1.39  # one share of GPT-2 small's weights, gradients and AdamW state (weight_units())


@pytest.mark.parametrize("name", ["delay-d4-n8", "delay-d8-n16"])
def test_auto_at_1f1bs_budget_picks_the_schedule_with_the_shortest_period(name):
    """Within torch 1F1B's memory, Chimera with backward halving has the shorter one-step makespan (D4N8: 1.225 s
    against ZB-V's 1.275 s) but ZB-V the shorter period over the 5 consecutive steps the row times (1.2 s against
    1.225 s), which is what ran faster (1.273-1.277 s against 1.288-1.333 s measured at D4N8)."""
    w = WORKLOADS[name]
    pick = auto_choice(w, torch_need(w, "1f1b", None, UNITS), UNITS)
    assert pick.label == "zb-v" and not pick.deferred
    assert pick.period == w.micro_batches * 3 * Fraction(str(w.tf))  # F, I and W of every micro-batch: no bubble


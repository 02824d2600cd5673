"""A whole node lost with ``--max-restarts``: the run continues on the node left from the last checkpoint, bitwise
equal to an uninterrupted run when its workers fit there, within 1e-5 when it is re-partitioned onto fewer stages.

The cluster is the script's own (tests/node_loss.py, in a process of its own): losing a node of the session's
cluster would break the tests after this one.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chimera.checkpoint import complete
from chimera.compile import compile_job
from chimera.config import load as load_config
from chimera.runtime import run_local
from chimera.runtime.checkpoint import load

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ray


def _final(ck: str) -> dict[str, torch.Tensor]:
    assert complete(ck)[-1].name == "step-00000008"
    return {k: v for k, v in load(ck).items() if not k.startswith("rng.")}


@pytest.mark.timeout(420)
def test_a_lost_node_is_survived_bitwise_or_repartitioned(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "node_loss.py"), str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    cfg, _ = load_config(tmp_path / "run.toml")
    for name, stages in (("fits", 2), ("refit", 4)):
        case = result[name]
        assert case["code"] == 0 and case["killed"], (name, case, p.stderr[-4000:])
        lines = [json.loads(x) for x in Path(case["metrics"]).read_text().splitlines()]
        [restart] = [x for x in lines if x.get("event") == "restart"]
        # the node's workers were found lost (dead, or silent until Ray declared their node dead)
        assert "lost with their node" in restart["error"] or "died" in restart["error"], restart
        assert restart["resumed_from_step"] >= 2 and restart["checkpoint"]
        assert sorted({x["step"] for x in lines if "step" in x}) == list(range(8))
        # the uninterrupted run, on the stages it started with
        ref = tmp_path / f"{name}-ref"
        run_local(compile_job(cfg.with_flags(stages=stages, checkpoint_dir=str(ref))))
        got, want = _final(case["checkpoint"]), _final(str(ref))
        assert sorted(got) == sorted(want)
        if name == "fits":  # the same layout on the node left: nothing lost, bit for bit
            assert "refit" not in restart
            assert all(torch.equal(got[k], want[k]) for k in want)
        else:  # two slots left for four workers: two stages, the same training in another order of sums
            assert restart["stages"] == 2 and "re-partitioned onto 2 stages" in restart["refit"]
            assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-5) for k in want)

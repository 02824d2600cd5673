"""The layout holds: every module under chimera/ imports and trains with Ray made unimportable."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import importlib, importlib.abc, pkgutil, sys

    class NoRay(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ImportError(f"{name} is unimportable in this test")
            return None

    sys.meta_path.insert(0, NoRay())
    import chimera
    names = [m.name for m in pkgutil.walk_packages(chimera.__path__, "chimera.") if not m.name.endswith("__main__")]
    for name in names:
        importlib.import_module(name)
    assert not [m for m in sys.modules if m == "ray" or m.startswith("ray.")]

    import torch
    from torch import nn
    data = lambda step, mb, rank: (torch.randn(2, 4), torch.randn(2, 1))
    chain = chimera.LayerChain([lambda: nn.Linear(4, 8), lambda: nn.Linear(8, 1)], nn.functional.mse_loss, data(0, 0, 0))
    records = chimera.train(chain, data, schedule="chimera", stages=2, micro_batches=2, steps=2)
    from chimera.cli import main
    assert main(["schedule", "show", "chimera", "-D", "2", "-N", "2"]) == 0
    print("imported", len(names), "modules; trained", len(records), "steps")
''')


def test_chimera_imports_and_runs_without_ray():
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "trained 2 steps" in p.stdout
    assert int(p.stdout.split("imported ")[1].split()[0]) >= 30

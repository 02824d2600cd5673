"""Driver and workers run the same chimera: local workers fork from a forkserver that imported the driver's copy,
and a worker refuses a job compiled by other code, before it joins the process group."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import chimera
from chimera.compile import compile_job
from chimera.config import TrainConfig
from chimera.runtime import WorkerError, run_local
from chimera.util.source import path_first, source_fingerprint, source_root

ROOT = Path(chimera.__file__).resolve().parents[1]

CHILD = """
import sys
sys.path.insert(0, {alt!r})
import chimera
from chimera.util.processes import forkserver_context


def child(q):
    import chimera.runtime.worker as w
    q.put(w.__file__)


if __name__ == "__main__":
    ctx = forkserver_context()
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(chimera.__file__)
    print(q.get(timeout=120))
    p.join()
"""


def test_local_workers_import_the_drivers_chimera_when_another_copy_is_installed(tmp_path: Path) -> None:
    # a second copy of the package, imported by a driver run from elsewhere; the repository's copy stays installed
    alt = tmp_path / "alt"
    shutil.copytree(ROOT / "chimera", alt / "chimera", ignore=shutil.ignore_patterns("__pycache__", "sample"))
    script = tmp_path / "run.py"
    script.write_text(CHILD.format(alt=str(alt)))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    driver, worker = out.stdout.split()[-2:]
    assert driver.startswith(str(alt)), driver
    assert worker.startswith(str(alt)), f"the worker forked from another chimera: {worker}"


def test_a_worker_refuses_a_job_compiled_by_other_code_before_it_starts() -> None:
    job = compile_job(TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=2, steps=1,
                                             partition="uniform", corpus="synthetic"))
    assert job.source == (source_fingerprint(), source_root())
    other = dataclasses.replace(job, source=("0" * 64, "/elsewhere"))
    with pytest.raises(WorkerError, match=r"runs chimera from .* but the job was compiled by chimera from /elsewhere "
                                          r"\(sources 000000000000\).*the same code"):
        run_local(other)
    assert len(run_local(job).metrics) == 1  # the same code: it trains


def test_the_fingerprint_follows_the_sources(tmp_path: Path) -> None:
    pkg = tmp_path / "chimera"
    shutil.copytree(ROOT / "chimera", pkg, ignore=shutil.ignore_patterns("__pycache__", "sample"))
    probe = ("import sys; sys.path.insert(0, {!r}); from chimera.util.source import source_fingerprint; "
             "print(source_fingerprint())")
    run = lambda: subprocess.run([sys.executable, "-c", probe.format(str(tmp_path))], cwd=tmp_path,  # noqa: E731
                                 capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    before = run()
    (pkg / "schedule" / "ir.py").write_text((pkg / "schedule" / "ir.py").read_text() + "\n# changed\n")
    assert run() != before


def test_a_driver_run_from_another_checkout_trains_on_local_ray_with_its_own_code(tmp_path: Path) -> None:
    """Local Ray actors import the driver's chimera (PYTHONPATH in their environment), not the installed copy; the
    workers' source check would refuse the job otherwise."""
    alt = tmp_path / "alt"
    for pkg in ("chimera", "ray_launch", "scripts"):
        shutil.copytree(ROOT / pkg, alt / pkg, ignore=shutil.ignore_patterns("__pycache__", "sample"))
    marker = alt / "chimera" / "schedule" / "ir.py"
    marker.write_text(marker.read_text() + "\n# another copy\n")  # other sources: other fingerprint
    ray_tmp = tempfile.mkdtemp(prefix="chs-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    env.pop("PYTHONPATH", None)
    try:
        out = subprocess.run([sys.executable, str(alt / "scripts" / "prof_steps_ray.py"), "--model", "bert-tiny",
                              "--stages", "2", "--micro-batches", "2", "--seq-len", "16", "--steps", "1",
                              "--partition", "uniform", "--corpus", "synthetic", "--no-progress",
                              "--run-dir", str(tmp_path / "run")],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "1 steps" in out.stdout  # trained: the workers ran the copy that compiled the job


def test_a_package_in_site_packages_is_not_put_before_the_standard_library(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/theirs")
    checkout, site = tmp_path / "checkout", tmp_path / "lib" / "site-packages"
    assert path_first(checkout / "chimera", checkout / "ray_launch", site / "x") == os.pathsep.join(
        [str(checkout.resolve()), "/theirs"])
    assert path_first(site / "chimera", tmp_path / "dist-packages" / "ray_launch") is None

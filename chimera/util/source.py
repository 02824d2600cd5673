"""Which chimera a process runs: a fingerprint of the package's Python sources, so that a worker can refuse a job
compiled by another version of the code (a driver run from one checkout, its workers importing an installed
copy) instead of training with it::

    from chimera.util.source import source_fingerprint, source_root

    source_fingerprint()   # e.g. "65e2ca1a8255..." (sha256 over every chimera/**/*.py, by relative path)
    source_root()          # the directory that holds the chimera package this process imported

A compiled ``Job`` carries both (``Job.source``); :func:`check_same_source` is the worker's check. Local workers
are started so that they import the driver's copy in the first place: :func:`path_first` is the ``PYTHONPATH`` the
forkserver (:mod:`chimera.util.processes`) and local Ray actors (``ray_launch.cluster.worker_env``) start with.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

#: the directory of the chimera package this process imported
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def source_root() -> str:
    """The directory holding the ``chimera`` package this process imported (what ``sys.path`` needs to find it)."""
    return str(PACKAGE_DIR.parent)


def path_first(*packages: str | Path) -> str | None:
    """A ``PYTHONPATH`` that puts the directories holding ``packages`` (package directories, e.g.
    ``Path(chimera.__file__).parent``) before the caller's own ``PYTHONPATH``, so that a child process imports the
    copies this one did; None where none needs it: a package installed into site-packages is what a fresh
    interpreter finds anyway, and putting site-packages first would shadow the standard library."""
    roots = [str(Path(p).resolve().parent) for p in packages]
    roots = [r for r in dict.fromkeys(roots) if Path(r).name not in ("site-packages", "dist-packages")]
    if not roots:
        return None
    return os.pathsep.join([*roots, *filter(None, [os.environ.get("PYTHONPATH")])])


@lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 over every ``.py`` file of the imported ``chimera`` package, in order of relative path (a few ms,
    once per process). Equal for two copies of the same code wherever they sit (a node's copy shipped by Ray)."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(path.relative_to(PACKAGE_DIR).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def check_same_source(compiled: tuple[str, str] | None, who: str) -> None:
    """Raise RuntimeError where ``compiled`` (the fingerprint and source root of the chimera that compiled a job;
    None: not recorded) is not the code this process runs, saying where each came from and how to align them."""
    if compiled is None or compiled[0] == source_fingerprint():
        return
    fingerprint, root = compiled
    raise RuntimeError(
        f"{who} runs chimera from {source_root()} (sources {source_fingerprint()[:12]}), but the job was compiled by "
        f"chimera from {root} (sources {fingerprint[:12]}): the driver and its workers must run the same code. "
        "Install the driver's checkout where the workers import from (pip install --no-deps -e <checkout>), or, on "
        "Ray, pass --ship-code to send it to them")

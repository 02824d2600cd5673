"""Ray driver, actors and cluster configuration for chimera."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any


def keep_local_ray_on_loopback(argv: Sequence[str]) -> None:
    """Before Ray is imported: when the command line joins no cluster (no ``--address``), make the local
    Ray that the driver starts bind 127.0.0.1 only.

    Ray's servers otherwise listen on every interface even with ``_node_ip_address="127.0.0.1"``; with
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read when Ray is imported) they use the loopback address, as
    Ray does on laptops. Token authentication stays on either way. The parsers take no abbreviated flags, so
    ``--address`` is the only spelling that joins a cluster.
    """
    joins = any(a == "--address" or a.startswith("--address=") for a in argv)
    if not joins and "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def train(chain: Any = None, data: Any = None, launch: Any = None, *, out: str | None = None, progress: bool = False,
          **fields: Any) -> list[dict[str, Any]]:
    """``chimera.train`` on Ray: the same chain, data and fields, one Ray actor per worker (``launch``: a
    :class:`ray_launch.config.LaunchConfig`, default a local Ray on loopback; ``out``: a metrics file, appended to;
    ``progress``: a progress bar). Returns one record per step. A restart onto nodes that cannot host every worker
    re-partitions onto fewer stages (``ray_launch.recovery``)."""
    keep_local_ray_on_loopback(["--address"] if launch is not None and launch.address else [])
    # imported here, not above: Ray reads the loopback setting when it is first imported
    from chimera.api import build_job
    from ray_launch.recovery import run

    def refit(stages: int, resume: str | None) -> Any:
        more = {"partition": "uniform"} if "," in str(fields.get("partition", "")) else {}
        return build_job(chain, data, **{**fields, **more, "stages": stages, "resume": resume})

    return run(build_job(chain, data, **fields), launch, out=out, progress=progress, refit=refit)

"""The ``chimera`` console script: chimera's commands plus ``train`` (on Ray), and ``profile --comm ray``.

    chimera train --model bert-tiny --stages 2 --micro-batches 4 --steps 10
    chimera train --config runs/NAME/config.toml --steps 20      # a run again, with one field changed

This module loads no Ray (``chimera schedule`` stays light); the local Ray a run starts is kept on loopback, which
must be decided before Ray is imported (:func:`ray_launch.keep_local_ray_on_loopback`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from chimera.cli import main as chimera_main
from chimera.cli import register_command, register_probe
from ray_launch import keep_local_ray_on_loopback

register_command("train", "ray_launch.command", "train on Ray: one actor per worker (chimera train --help lists the "
                 "sections and their flags)")
register_probe("ray", "ray_launch.commprobe:probe_from_args")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``chimera`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    keep_local_ray_on_loopback(argv)
    return chimera_main(argv)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Train on an existing multi-node Ray cluster (joins --address auto by default).

    python scripts/prof_steps_ray_multinode.py --address auto --placement pack \
        --pre-cmd "nvidia-smi -L" --env NCCL_SOCKET_IFNAME=eth0 --device cuda --stages 4 --data-parallel 2

chimera's packages travel to the workers with Ray's runtime_env (py_modules); --pre-cmd runs once on every node
through Ray; NCCL_*/GLOO_* variables of this shell and --env KEY=VALUE reach every worker. The worker -> node map
is printed before training. Same flags as scripts/prof_steps_ray.py otherwise.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_launch.command import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main(defaults={"address": "auto"}))

#!/usr/bin/env python
"""Train with a Chimera (or 1F1B / GPipe) pipeline on Ray: ``chimera train`` with its defaults (local Ray, CPU,
bert-mini, D=4, N=4, the partition planned from a brief profile).

    python scripts/prof_steps_ray.py --model bert-mini --schedule chimera --stages 4 --micro-batches 4 \
        --micro-batch-size 4 --data-parallel 1 --steps 10 --device cpu --seed 1234 --output runs/run.jsonl
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_launch import keep_local_ray_on_loopback  # noqa: E402

keep_local_ray_on_loopback(sys.argv[1:])
from ray_launch.command import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main())

"""Metrics records as TensorBoard scalars (``--tensorboard``): every number of a step's record (loss, lr,
step_time_s, samples_per_s, tokens_per_s, grad_norm, ...) as the scalar ``train/NAME`` at that step.

    writer = TensorBoardWriter("runs/NAME-TIME/tensorboard")
    writer.write(record)        # a step's record; event lines (resume, restart, stopped) are skipped
    writer.close()

Written with ``torch.utils.tensorboard``, which needs the ``tensorboard`` package (``pip install
'chimera[tensorboard]'``); view with ``tensorboard --logdir runs``.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

MISSING = ("--tensorboard needs the tensorboard package, which is not installed: pip install 'chimera[tensorboard]' "
           "(or pip install tensorboard), or drop --tensorboard")


def available() -> bool:
    """Whether the ``tensorboard`` package can be imported."""
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except ValueError:  # a module set to None in sys.modules (how the tests hide it)
        return False


class TensorBoardWriter:
    """Writes the scalars of metrics records to one TensorBoard log directory (module docstring)."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(MISSING) from None
        self.logdir = Path(logdir)
        self.writer = SummaryWriter(str(self.logdir))

    def write(self, record: dict[str, Any]) -> None:
        """Add the record's numbers (not ``step`` itself, booleans or non-finite values) at its step."""
        if "event" in record or "step" not in record:
            return
        step = int(record["step"])
        for name, value in record.items():
            if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(f"train/{name}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

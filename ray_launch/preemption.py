"""SIGTERM to a training driver (what SLURM and Kubernetes send before they take the machines back): finish the
steps in flight, write a final checkpoint, and exit within a grace period.

    stop = Preemption(grace_s=30, can_save=job.checkpoint.dir is not None)
    run(job, launch, stop=stop)          # installs it once Ray is up (ray.init sets a SIGTERM handler of its own)
    stop.requested                       # True once SIGTERM came

The first SIGTERM only sets ``requested``: the driver queues no more steps, lets the queued ones finish, asks every
worker to save the state after the last one, and returns. A second SIGTERM, or the grace period running out first,
raises :class:`Terminated` in the driver's main thread: everything it started is stopped at once (the last complete
checkpoint stays; a write cut short leaves only a ``.partial`` directory, removed by the next launch). Without a
checkpoint directory the first SIGTERM stops at once: there is nowhere to save to.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)


class Terminated(KeyboardInterrupt):
    """The driver was told to stop at once (a second SIGTERM, the grace period spent, or nowhere to save)."""


class Preemption:
    """SIGTERM handling of one run (module docstring); install in the main thread."""

    def __init__(self, grace_s: float, can_save: bool) -> None:
        self.grace_s = grace_s
        self.can_save = can_save
        self.requested = False
        self.since: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle SIGTERM from now on; again after ``ray.init``, which sets a handler of its own. A no-op outside
        the main thread, where Python cannot set signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, h in ((signal.SIGTERM, self._on_term), (signal.SIGALRM, self._on_alarm)):
            previous = signal.signal(s, h)
            self._previous.setdefault(s, previous)  # the handler before the first install

    def restore(self) -> None:
        """Cancel the grace timer and put the earlier handlers back."""
        if not self._previous:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def left_s(self) -> float:
        """Seconds of the grace period left (all of it before SIGTERM)."""
        return self.grace_s if self.since is None else max(0.0, self.grace_s - (time.monotonic() - self.since))

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise Terminated("a second SIGTERM: stopped at once")
        self.requested = True
        self.since = time.monotonic()
        if not self.can_save:
            raise Terminated("SIGTERM without --checkpoint-dir: stopped at once, nothing saved")
        logger.warning("SIGTERM: finishing the steps in flight, then writing a checkpoint (within %g s; another "
                       "SIGTERM stops at once)", self.grace_s)
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise Terminated(f"the grace period ({self.grace_s:g} s, --grace-period) ran out before the checkpoint "
                             "was written: stopped at once")

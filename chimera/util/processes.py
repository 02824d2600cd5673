"""Processes on this machine forked from one preloaded forkserver: the runtime's local workers and the profiler's
measuring processes start the same way (well under a second each, torch and the presets imported once).

    with LocalProcesses(_main, [(0,), (1,)], ProfileError, "probe process") as procs:
        for msg in procs.messages(60, waiting=lambda: "process 1"):
            ...
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import time
from collections.abc import Iterator
from multiprocessing import forkserver
from typing import Any

import torch.multiprocessing as mp

from chimera.util.source import PACKAGE_DIR, path_first

#: imported once by the forkserver (names, not imports: this module stays below everything it preloads)
PRELOAD = ["torch", "chimera.runtime.worker", "chimera.models.bert", "chimera.models.gpt2"]


def forkserver_context() -> Any:
    """A forkserver that has imported torch, chimera and the transformer presets once (several seconds), so that
    workers start in well under a second; its chimera is this process's (:func:`_start_forkserver`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start the forkserver (if it is not running) with this process's chimera first on its path.

    Python 3.11's forkserver imports its preload modules before it takes this process's ``sys.path``: from its own
    working directory and site-packages. A driver that imported chimera from a checkout while another copy is
    installed would fork every worker from the installed one."""
    path = path_first(PACKAGE_DIR)
    old = os.environ.get("PYTHONPATH")
    if path is not None:
        os.environ["PYTHONPATH"] = path
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@contextlib.contextmanager
def main_not_rerun() -> Iterator[None]:
    """While processes start: hide the main script from multiprocessing, which would otherwise run it again in
    every worker (a script without an ``if __name__ == "__main__"`` guard would start training there too). The
    job needs nothing from it: cloudpickle carried its functions by value."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class LocalProcesses:
    """Processes forked from the preloaded forkserver, one per argument tuple, each called as
    ``target(*args, queue)``; a context manager that starts them with the main script hidden and, on exit, joins
    them (terminating any still alive). :meth:`messages` yields what they put on the queue until told to stop,
    raising ``error`` when one died without a word or the deadline passed (``name``: what a process is called in
    those messages, e.g. ``"worker"``).

        with LocalProcesses(_main, [(0,), (1,)], ProfileError, "probe process") as procs:
            for msg in procs.messages(60, waiting=lambda: "process 1"):
                ...
    """

    def __init__(self, target: Any, args: list[tuple[Any, ...]], error: type[Exception], name: str) -> None:
        ctx = forkserver_context()
        self.queue = ctx.Queue()
        self.procs = [ctx.Process(target=target, args=(*a, self.queue), daemon=True) for a in args]
        self.error, self.name = error, name
        self.finished = False

    def __enter__(self) -> LocalProcesses:
        with main_not_rerun():
            for p in self.procs:
                p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.join(timeout=5 if self.finished else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)

    def messages(self, deadline_s: float, waiting: Any) -> Iterator[Any]:
        """Messages until the caller stops; ``waiting()`` names what is still awaited (for the deadline's error)."""
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                yield self.queue.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise self.error(f"{self.name} {dead[0]} exited with code {self.procs[dead[0]].exitcode}"
                                     ) from None
                if time.monotonic() > deadline:
                    raise self.error(f"no answer within {deadline_s:.0f} s; still waiting for {waiting()}") from None

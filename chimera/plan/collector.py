"""Python's cyclic garbage collector paused while planning (:func:`collector_paused`)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while planning (as it was after): the planner makes millions of small
    acyclic objects (actions), over which the collector's passes took a fifth of its time and freed nothing.

    After, what survived (mostly the build cache's actions) goes straight to the oldest generation (a freeze undone
    at once: a move, no scan) instead of being scanned by the youngest generation's next pass, which cost 0.4 s
    after a plan at K = 2048; cycles among it are still freed, by the next full collection. Not where someone
    else holds objects frozen (their freeze is theirs to undo)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()

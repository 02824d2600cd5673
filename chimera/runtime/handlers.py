"""What a worker does for each action kind: one handler factory per kind of the kinds table.

A factory is called once per worker at set-up with the :class:`~chimera.runtime.worker.PipelineWorker` and returns
the handler ``(action, step_state) -> None``. The built-in kinds register theirs in :mod:`chimera.runtime.worker`; a
new kind registers its own next to its row (``chimera.schedule.kinds.register_kind``)::

    register_handler(Kind.NOTE, lambda worker: lambda action, st: worker.notes.append(action))

Send and receive kinds need none: the communication batches post them. A kind whose handler is missing is looked
for in the module its row names (``KindSpec.module``, imported in the worker), then refused before the first step.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from chimera.runtime.step_state import StepState
from chimera.schedule import Action, Kind

Handler = Callable[[Action, StepState], None]
HandlerFactory = Callable[[Any], Handler]

HANDLERS: dict[str, HandlerFactory] = {}


def register_handler(kind: Kind, factory: HandlerFactory) -> None:
    """The handler factory of ``kind`` (replaces an earlier one)."""
    HANDLERS[kind.value] = factory


def handlers_for(worker: Any, kinds: Iterable[Kind]) -> dict[Kind, Handler]:
    """The handlers of ``kinds`` (send and receive kinds excepted) for one worker; RuntimeError naming the kinds
    without one."""
    needed = {k for k in kinds if not k.is_p2p}
    for kind in needed:
        if kind.value not in HANDLERS and kind.spec.module:
            importlib.import_module(kind.spec.module)  # registers the handler where the kind was registered
    missing = sorted(k.value for k in needed if k.value not in HANDLERS)
    if missing:
        raise RuntimeError(f"{worker.name}: the runtime has no handler for action kind(s) {', '.join(missing)}; "
                           "register one with chimera.runtime.handlers.register_handler next to the kind's row")
    return {kind: HANDLERS[kind.value](worker) for kind in needed}

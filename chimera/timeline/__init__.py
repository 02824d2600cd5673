"""Timelines: events, plots (and, with the runtime, Chrome traces)."""

from chimera.timeline.events import Event, events_from_simulation

__all__ = ["Event", "events_from_simulation"]

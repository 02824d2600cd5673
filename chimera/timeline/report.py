"""Profile outputs of a run: events file, Chrome trace, timeline figure (measured + predicted), summary JSON.

Files in the run's directory, with NAME the run's name (``{model}_{schedule}_{D}stages_{W}workers_microbs{B}_acc{K}``, ``gpus`` on CUDA):

* ``NAME.events.json``: every recorded event plus the run's metadata (re-plot without re-running);
* ``NAME.trace.json``: Chrome trace format (one process per worker, one thread per pipe; open in Perfetto);
* ``NAME.pdf`` / ``NAME.png``: measured timeline (top) and the simulator's timeline with per-stage costs taken
  from the measured run (bottom);
* ``NAME.json``: per-worker busy time, measured bubble fraction, mean iteration time, the run's predicted step time
  (``predicted_step_s``: the one prediction, the same the run's summary prints) and the schedule replayed with the
  measured per-stage times (``replayed_iteration_s``);
  with offload the bytes swapped per step (``swap_bytes_per_step``, per worker) and the swap time per iteration
  hidden under compute and exposed (``swap_s_hidden``, ``swap_s_exposed``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chimera.schedule import Costs, Schedule, from_json, simulate, to_json
from chimera.schedule.kinds import Address
from chimera.timeline.analysis import step_stats, swap_time
from chimera.timeline.events import Event, events_from_simulation, is_swap, kind_of

PIPE_TID = {"down": 0, "up": 1, "down2": 3, "up2": 4}  # down2 / up2: four-pipe Chimera
SWAP_TID = 2  # offload's swaps: a row of their own per worker


def chrome_trace(events: Sequence[Event], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Chrome trace JSON: complete ("X") events in microseconds from the first event, named like the action."""
    t0 = min((e.start for e in events), default=0.0)
    out: list[dict[str, Any]] = []
    pipes = {"down", "up"} | {e.pipe for e in events}  # both directions always; four-pipe Chimera's where present
    for w in sorted({e.worker for e in events}):
        out.append({"name": "process_name", "ph": "M", "pid": w, "tid": 0, "args": {"name": f"worker {w}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": w, "tid": 0, "args": {"sort_index": w}})
        for pipe, tid in PIPE_TID.items():
            if pipe not in pipes:
                continue
            out.append({"name": "thread_name", "ph": "M", "pid": w, "tid": tid, "args": {"name": f"{pipe} pipe"}})
        if any(is_swap(e.kind) for e in events):
            out.append({"name": "thread_name", "ph": "M", "pid": w, "tid": SWAP_TID, "args": {"name": "swaps"}})
    for e in events:
        mb = "" if e.microbatch < 0 else (str(e.microbatch) if e.count == 1 else f"{e.microbatch}-{e.microbatch + e.count - 1}")
        kind = kind_of(e.kind)
        name = kind.value if kind and kind.spec.address is Address.NONE else f"{e.pipe[0]}{e.stage}{e.kind}{mb}"
        out.append({
            "name": name, "cat": e.kind, "ph": "X", "pid": e.worker,
            "tid": SWAP_TID if is_swap(e.kind) else PIPE_TID.get(e.pipe, 0),
            "ts": (e.start - t0) * 1e6, "dur": max(0.0, e.duration) * 1e6,
            "args": {"iteration": e.iteration, "stage": e.stage, "microbatch": e.microbatch, "pipe": e.pipe},
        })
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta or {}}


def measured_costs(events: Sequence[Event], stages: int) -> Costs:
    """Mean duration per stage of F, of B (or of I, where the backward is split) and of W, from measured events (as
    simulator costs, seconds)."""
    def mean(kind: str, s: int) -> float | None:
        d = [e.duration / e.count for e in events if e.kind == kind and e.stage == s]
        return statistics.fmean(d) if d else None

    fwd, bwd, wgrad = [], [], []
    for s in range(stages):
        fwd.append(mean("F", s) or 0.0)
        b = mean("B", s)
        bwd.append(b if b is not None else mean("I", s) or 0.0)
        wgrad.append(mean("W", s) or 0.0)
    return Costs(fwd=fwd, bwd=bwd, wgrad=wgrad, p2p_latency=0.0, optimizer=0.0)


def summarize(events: Sequence[Event], schedule: Schedule, workers: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Summary numbers of a profile (what ``NAME.json`` holds)."""
    stats = step_stats(events, range(workers))
    pred = simulate(schedule.compute_only(), measured_costs(events, schedule.stages))
    busy = {w: statistics.fmean(s.busy[w] for s in stats) for w in range(workers)}
    swaps = swap_time(events)
    return {
        **meta,
        "workers": workers,
        "iterations": [s.iteration for s in stats],
        "iteration_s": [s.makespan for s in stats],
        "mean_iteration_s": statistics.fmean(s.makespan for s in stats),
        "measured_bubble": statistics.fmean(s.bubble for s in stats),
        "busy_s": {str(w): b for w, b in busy.items()},
        # the schedule replayed with this run's own measured F/B/W times: what the bubble alone costs; the run's
        # one prediction (from the profile, before it started) is ``predicted_step_s`` in ``meta``
        "replayed_iteration_s": float(pred.makespan),
        "replayed_bubble": float(pred.bubble),
        **({"swap_s_hidden": swaps["hidden"], "swap_s_exposed": swaps["exposed"]} if swaps["hidden"] + swaps["exposed"]
           else {}),
    }


def timeline_figure(events: Sequence[Event], schedule: Schedule, workers: int, summary: dict[str, Any]) -> Any:
    """Two panels: the measured timeline and the simulator's, one row per worker each."""
    import matplotlib.pyplot as plt

    from chimera.timeline.plot import plot_timeline

    t0 = min(e.start for e in events)
    shifted = [Event(e.worker, e.kind, e.pipe, e.stage, e.microbatch, e.start - t0, e.end - t0, e.iteration, e.count)
               for e in events]
    bounds = sorted({min(e.start for e in shifted if e.iteration == it) for it in {e.iteration for e in shifted}})
    height = 0.55 * workers + 1.8
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 2 * height), gridspec_kw={"hspace": 0.6})
    label = "" if summary.get("training_result", True) else "  [single-byte payload: NOT a training result]"
    plot_timeline(shifted, workers, ax=top, time_unit="s", iteration_bounds=bounds[1:],
                  title=(f"{summary.get('name', '')}  measured: utilization {1 - summary['measured_bubble']:.1%}, "
                         f"mean iteration {summary['mean_iteration_s']:.3f} s{_predicted(summary)}{label}"))
    pred = simulate(schedule.compute_only(), measured_costs(events, schedule.stages))
    sim = []
    for g in range(workers // schedule.workers):  # every data-parallel group runs the same lists
        sim += [Event(e.worker + g * schedule.workers, e.kind, e.pipe, e.stage, e.microbatch, e.start, e.end, 0,
                      e.count) for e in events_from_simulation(pred)]
    plot_timeline(sim, workers, ax=bottom, time_unit="s",
                  title=(f"simulated with the measured per-stage F/B times: iteration {float(pred.makespan):.3f} s, "
                         f"utilization {1 - float(pred.bubble):.1%}"))
    return fig


def _predicted(summary: dict[str, Any]) -> str:
    """The run's one prediction, as the summary prints it, for the figure's title."""
    step = summary.get("predicted_step_s")
    return f" (predicted {step:.3f} s: {summary.get('prediction', '')})" if step else ""


def write_profile(name: str, events: Sequence[Event], schedule: Schedule, workers: int, meta: dict[str, Any],
                  out_dir: str | Path = "profiles") -> dict[str, Path]:
    """Write the events file, Chrome trace, figure (PDF + PNG) and summary JSON; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"name": name, **meta}
    paths = {"events": out / f"{name}.events.json", "trace": out / f"{name}.trace.json",
             "summary": out / f"{name}.json"}
    paths["events"].write_text(json.dumps({"meta": meta, "workers": workers, "schedule": json.loads(to_json(schedule)),
                                           "events": [e.as_dict() for e in events]}))
    return paths | render(paths["events"], out)


def load_events(path: str | Path) -> tuple[list[Event], Schedule, int, dict[str, Any]]:
    """Read a ``NAME.events.json`` file."""
    d = json.loads(Path(path).read_text())
    events = [Event(**e) for e in d["events"]]
    return events, from_json(json.dumps(d["schedule"])), d["workers"], d["meta"]


def render(events_path: str | Path, out_dir: str | Path | None = None,
           events: Sequence[Event] | None = None) -> dict[str, Path]:
    """(Re)build trace, figure and summary from an events file (or from ``events`` replacing its events)."""
    import matplotlib.pyplot as plt

    from chimera.timeline.plot import save_figure

    loaded, schedule, workers, meta = load_events(events_path)
    events = list(events) if events is not None else loaded
    if not events:
        raise ValueError(f"{events_path}: no events to plot (was the run made with --profile?)")
    name = meta["name"]
    out = Path(out_dir) if out_dir is not None else Path(events_path).parent
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(events, schedule, workers, meta)
    paths = {"trace": out / f"{name}.trace.json", "summary": out / f"{name}.json"}
    paths["trace"].write_text(json.dumps(chrome_trace(events, meta)))
    paths["summary"].write_text(json.dumps(summary, indent=2))
    fig = timeline_figure(events, schedule, workers, summary)
    pdf, png = save_figure(fig, out / name)
    plt.close(fig)
    return paths | {"pdf": pdf, "png": png}

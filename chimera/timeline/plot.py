"""Worker x time timeline figures (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from chimera.schedule.ir import DIRECTION, PIPE_PREFIX  # noqa: E402
from chimera.timeline.events import SWAP_FAMILIES, Event, family, is_compute  # noqa: E402

# Compute boxes by the display family of their kind (the kinds table's column): forward and backward in two
# colour families (a split backward's input-gradient part is a backward), the up pipe in a darker shade of each.
COLORS = {
    ("forward", "down"): "#8ecae6",
    ("forward", "up"): "#219ebc",
    ("backward", "down"): "#ffb703",
    ("backward", "up"): "#fb8500",
    ("weight", "down"): "#95d5b2",  # the weight-gradient part
    ("weight", "up"): "#2d6a4f",
}
OTHER_COLOR = "#9e9e9e"  # a kind of a family this figure has no colour for
SYNC_COLOR = "#bdbdbd"
COMM_COLOR = "#e5e5e5"
SWAP_COLORS = {"swap-in": "#8ac926", "grad-out": "#6a4c93", "swap-out": "#c9c9c9"}


def _label(e: Event, bidirectional: bool) -> str:
    mb = str(e.microbatch) if e.count == 1 else f"{e.microbatch}-{e.microbatch + e.count - 1}"
    return (PIPE_PREFIX.get(e.pipe, "") + mb) if bidirectional else mb


def plot_timeline(
    events: Sequence[Event],
    workers: int,
    *,
    title: str = "",
    ax: plt.Axes | None = None,
    show_comm: bool = False,
    time_unit: str = "",
    iteration_bounds: Sequence[float] = (),
) -> plt.Figure:
    """Draw one row per worker: F/B boxes coloured by kind and pipe, gradient sync hatched; with offload, each
    worker's swaps (weights in, gradients out) on a row of their own below it.

    Returns the figure; rows are ``ax.get_yticks()`` (one per worker, worker 0 on top; two with swaps).
    """
    own = ax is None
    if ax is None:
        width = min(24.0, 6.0 + 0.05 * len(events) / max(1, workers))
        fig, ax = plt.subplots(figsize=(width, 0.6 * workers + 1.6))
    else:
        fig = ax.figure
    bidirectional = any(e.pipe != "down" for e in events)
    span = max((e.end for e in events), default=1.0) - min((e.start for e in events), default=0.0)
    fam = {e.kind: family(e.kind) for e in events}
    rows = 2 if any(f in SWAP_FAMILIES for f in fam.values()) else 1
    for e in events:
        y = rows * (workers - 1 - e.worker) + rows - 1
        f = fam[e.kind]
        if f in SWAP_FAMILIES:
            if e.duration > 0:
                ax.broken_barh([(e.start, e.duration)], (y - 1 - 0.3, 0.6), facecolors=SWAP_COLORS[f],
                               edgecolors="black", linewidth=0.3)
        elif is_compute(e.kind):
            color = COLORS.get((f, DIRECTION.get(e.pipe, "down")), OTHER_COLOR)
            ax.broken_barh([(e.start, e.duration)], (y - 0.4, 0.8), facecolors=color, edgecolors="black",
                           linewidth=0.4)
            if e.duration > span / 60:
                ax.text(e.start + e.duration / 2, y, _label(e, bidirectional), ha="center", va="center", fontsize=7)
        elif f == "sync" and e.duration > 0:
            ax.broken_barh([(e.start, e.duration)], (y - 0.4, 0.8), facecolors=SYNC_COLOR, edgecolors="black",
                           hatch="///", linewidth=0.4)
        elif show_comm and f == "message" and e.duration > 0:
            ax.broken_barh([(e.start, e.duration)], (y - 0.2, 0.4), facecolors=COMM_COLOR, edgecolors="none")
        elif f not in ("message", "sync", "update") and e.duration > 0:
            ax.broken_barh([(e.start, e.duration)], (y - 0.3, 0.6), facecolors=OTHER_COLOR, edgecolors="none")
    for t in iteration_bounds:
        ax.axvline(t, color="red", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(rows * workers))
    names = [[f"worker {w}"] if rows == 1 else [f"w{w} swaps", f"worker {w}"] for w in range(workers - 1, -1, -1)]
    ax.set_yticklabels([n for pair in names for n in pair])
    ax.set_ylim(-0.6, rows * workers - 0.4)
    ax.set_xlabel(f"time{f' ({time_unit})' if time_unit else ''}")
    _legend(ax, events, bidirectional, rows, workers)
    if title:
        ax.set_title(title, fontsize=10)
    if own:
        fig.tight_layout()
    return fig


def _legend(ax: plt.Axes, events: Sequence[Event], bidirectional: bool, rows: int, workers: int) -> None:
    down = " (down)" if bidirectional else ""
    handles = [Patch(facecolor=COLORS[("forward", "down")], edgecolor="black", label="forward" + down),
               Patch(facecolor=COLORS[("backward", "down")], edgecolor="black", label="backward" + down)]
    if bidirectional:
        handles += [Patch(facecolor=COLORS[("forward", "up")], edgecolor="black", label="forward (up)"),
                    Patch(facecolor=COLORS[("backward", "up")], edgecolor="black", label="backward (up)")]
    families = {family(e.kind) for e in events}
    if "weight" in families:
        handles.append(Patch(facecolor=COLORS[("weight", "down")], edgecolor="black", label="weight gradient (W)"))
    if rows == 2:
        handles += [Patch(facecolor=SWAP_COLORS[k], edgecolor="black", label=label)
                    for k, label in (("swap-in", "weights in"), ("grad-out", "gradients out"))]
    if any(family(e.kind) == "sync" and e.duration > 0 for e in events):
        handles.append(Patch(facecolor=SYNC_COLOR, edgecolor="black", hatch="///", label="gradient sync"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 if workers < 6 else -0.1),
              ncol=len(handles), fontsize=8, frameon=False)


def save_figure(fig: plt.Figure, path: str | Path) -> list[Path]:
    """Save ``fig`` at ``path``; a path without suffix is written as both PDF and PNG."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    paths = [p] if p.suffix else [p.with_suffix(".pdf"), p.with_suffix(".png")]
    for q in paths:
        fig.savefig(q, dpi=150, bbox_inches="tight")
    return paths

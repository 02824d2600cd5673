"""What offload costs, in the terms the planner prices it: a packed stage's exposed copy time and the layers of
each pack.

    packs_of([4, 5, 6, 7, 8], pack=2)                  # [[4, 5], [6, 7], [8]]
    exposed_copy_s([0.2, 0.2, 0.1], compute_s=0.3, overlap=True)   # 0.2: the first pack's copy, the rest hidden
"""

from __future__ import annotations

from collections.abc import Sequence


def packs_of(layers: Sequence[int], pack: int) -> list[list[int]]:
    """The layers of each pack of ``pack`` consecutive layers (the last may be shorter)."""
    return [list(layers[j:j + pack]) for j in range(0, len(layers), pack)]


def exposed_copy_s(copy_s: Sequence[float], compute_s: float, overlap: bool) -> float:
    """Seconds a packed stage's forward or backward takes beyond its compute for its pack copies: every copy on
    CPU (synchronous); with a copy stream (GPU) the first pack's, and what the others take beyond the compute they
    run beside."""
    if not copy_s:
        return 0.0
    return copy_s[0] + max(0.0, sum(copy_s[1:]) - compute_s) if overlap else sum(copy_s)

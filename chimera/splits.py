"""Contiguous splits of a sequence of layers into stages (pure Python: the planner's CLI path imports no torch)."""

from __future__ import annotations

from collections.abc import Sequence


def min_max_split(counts: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of ``counts`` into ``stages`` non-empty parts minimising the maximum part sum (part sizes).

    The ``"params"`` method splits parameter counts with it; the planner splits measured compute."""
    n = len(counts)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-sum splitting the first i layers into k stages; arg for reconstruction
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], arg[k][i] = cost, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        j = arg[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def layers_of(sizes: Sequence[int]) -> list[list[int]]:
    """Stage -> consecutive layer indices, for stage sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out

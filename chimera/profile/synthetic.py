"""Profiles made from numbers instead of measurements: for planning hardware one does not have (what-if) and
for testing the planner. ``bert48_paper_like()`` is the setting of the Chimera paper's BERT-48 runs."""

from __future__ import annotations

from collections.abc import Sequence

from chimera.profile import CommProfile, LayerCost, LayerProfile, Link, Profile, Timing


def layer(index: int, fwd: float, param_bytes: int, stash: int, out: int, sizes: Sequence[int],
          bwd_factor: float = 2.0) -> LayerProfile:
    """A layer whose time and activation bytes grow linearly with the micro-batch size."""
    costs = {}
    for b in sizes:
        def t(x: float, b: int = b) -> Timing:
            return Timing(x * b, 0.0, 3)
        costs[b] = LayerCost(t(fwd), t(fwd * bwd_factor / 2), t(fwd * bwd_factor / 2), t(fwd * bwd_factor), t(fwd),
                             stash * b, out * b, out * b)
    return LayerProfile(index, "synthetic", param_bytes // 4, param_bytes,
                        {"adamw": 2 * param_bytes, "lamb": 2 * param_bytes, "sgd": 0}, costs)


def comm(latency: float = 1e-4, bandwidth: float = 1e9) -> CommProfile:
    """A ring-allreduce-like model: 2(n-1)/n of the buffer crosses each link."""
    return CommProfile(Link(latency, bandwidth),
                       {n: Link(latency * 2 * (n - 1), bandwidth * n / (2 * (n - 1))) for n in (2, 4, 8, 16, 32, 64)},
                       "synthetic", "numbers")


def profile(layers: list[LayerProfile], sizes: Sequence[int], with_comm: bool = True, name: str = "synthetic"
            ) -> Profile:
    return Profile(name, "synthetic", "cpu", "float32", {}, 1, list(sizes), layers,
                   comm=comm() if with_comm else None)


def bert48_paper_like() -> Profile:
    """BERT-48 (1024 hidden, 128 tokens) on P100-class GPUs as in the Chimera paper's setting: a block ~12.6M
    parameters and ~1.1 ms forward per sample, the embeddings and the head ~31M parameters, ~10 GB/s links."""
    sizes = (1, 2, 4, 8, 16, 32)
    layers = [layer(i, 0.0004 if i in (0, 49) else 0.0011, 4 * (31_000_000 if i in (0, 49) else 12_600_000),
                    12_000_000, 128 * 1024 * 4, sizes) for i in range(50)]
    return Profile("bert-48", "synthetic", "cuda", "float32", {}, 1, list(sizes), layers,
                   comm=comm(latency=5e-6, bandwidth=1e10), device_memory_bytes=16 * 2**30)

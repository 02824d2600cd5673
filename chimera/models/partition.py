"""Split the layers of a :class:`LayerChain` into ``D`` consecutive, non-empty stages.

Methods:

- ``"uniform"``: balance the inner layers (a transformer's blocks). The ``L`` layers between the first and the
  last are spread as evenly as possible over the ``D`` stages; the first layer (embeddings) joins stage 0 and
  the last (head) joins stage ``D-1``. When they do not divide evenly, the extra layers go to the middle
  stages first, then to stage 0, and to the last stage only as a last resort, because the first and last
  stages already carry the embeddings and the (large, vocabulary-sized) head. With ``D > L`` the first and
  then the last layer get stages of their own.
- ``"params"``: contiguous split that minimises the largest per-stage parameter count (a tied weight
  counts in each stage that stores a copy).
- explicit: a list of ``D`` stage sizes (layers per stage, summing to ``num_layers``), a list of ``D+1``
  boundaries ``[0, b1, ..., num_layers]``, or the same as a comma-separated string (``"3,3,2"``).
"""

from __future__ import annotations

from collections.abc import Sequence

from chimera.models.chain import LayerChain
from chimera.splits import layers_of, min_max_split


def _check_stages(model: LayerChain, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"the number of stages must be >= 1, got D={stages}; use --stages >= 1")
    if stages > model.num_layers:
        raise ValueError(
            f"D={stages} is larger than the {model.num_layers} layers of {model.name}; "
            f"use --stages <= {model.num_layers} or a deeper model"
        )


def _uniform_sizes(num_blocks: int, stages: int) -> list[int]:
    """Layers per stage for the ``"uniform"`` method (see module docstring)."""
    if stages == 1:
        return [num_blocks + 2]
    if stages > num_blocks:  # one block per stage; embeddings, then head, get their own stage
        blocks = [1] * num_blocks
        if stages == num_blocks + 1:  # head alone: it is the heavier of the two ends
            return [2, *blocks[1:], 1]
        return [1, *blocks, 1]
    base, extra = divmod(num_blocks, stages)
    blocks = [base] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1]
    for s in order[:extra]:
        blocks[s] += 1
    blocks[0] += 1
    blocks[-1] += 1
    return blocks


def _explicit(model: LayerChain, stages: int, spec: Sequence[int]) -> list[int]:
    spec = [int(x) for x in spec]
    n = model.num_layers
    hint = (
        f"give {stages} stage sizes summing to {n} (e.g. {_uniform_sizes(model.num_layers - 2, stages)}) "
        f"or {stages + 1} boundaries from 0 to {n}"
    )
    if len(spec) == stages:
        if any(s < 1 for s in spec) or sum(spec) != n:
            raise ValueError(
                f"stage sizes {spec} must be >= 1 and sum to the {n} layers of {model.name}; {hint}"
            )
        return spec
    if len(spec) == stages + 1:
        ok = spec[0] == 0 and spec[-1] == n and all(a < b for a, b in zip(spec, spec[1:]))
        if not ok:
            raise ValueError(
                f"boundaries {spec} must rise strictly from 0 to {n} ({model.name} has {n} layers); {hint}"
            )
        return [b - a for a, b in zip(spec, spec[1:])]
    raise ValueError(f"explicit partition {spec} has {len(spec)} entries for D={stages}; {hint}")


def partition(model: LayerChain, stages: int, method: str | Sequence[int] = "uniform") -> list[list[int]]:
    """Layer indices of each of the ``stages`` stages (consecutive, covering all layers, non-empty)."""
    _check_stages(model, stages)
    if isinstance(method, str):
        if method == "uniform":
            sizes = _uniform_sizes(model.num_layers - 2, stages)
        elif method == "params":
            sizes = min_max_split(model.layer_num_params(), stages)
        elif method.replace(",", "").replace(" ", "").isdigit():
            sizes = _explicit(model, stages, [int(x) for x in method.split(",") if x.strip()])
        else:
            raise ValueError(
                f"unknown partition method {method!r}; use 'uniform', 'params', "
                "a list of stage sizes or boundaries, or a comma-separated string of them"
            )
    else:
        sizes = _explicit(model, stages, method)
    return layers_of(sizes)

"""A profile of bytes without timings, from the chain's shapes alone (the meta device: nothing is computed).

The configuration check prices ``--memory-per-worker`` with it before any worker starts: parameter and optimizer
bytes are exact, the stash is what autograd saves during a meta-device forward of each layer (each saved
tensor counted once, parameters excluded), input and output bytes come from the chain's boundaries. Timings are
zero: it prices memory, not time (``chimera profile`` measures both).
"""

from __future__ import annotations

from typing import Any

import torch

from chimera.microbatch import resized, tensors
from chimera.models import LayerChain
from chimera.models.chain import as_tuple, call
from chimera.optim import OPTIMIZERS
from chimera.profile.format import LayerCost, LayerProfile, Profile, Timing, fingerprint

#: optimizer state per parameter byte: LAMB and AdamW keep two moments, plain SGD nothing
STATE_FACTOR = {"lamb": 2, "adamw": 2, "sgd": 0}
assert set(STATE_FACTOR) == set(OPTIMIZERS)


def shapes_profile(chain: LayerChain, unit: int) -> Profile:
    """Bytes of every layer of ``chain`` at ``unit`` samples per micro-batch (module docstring)."""
    specs = chain.boundaries(unit)
    inputs, labels = resized(chain.example, unit)
    zero = Timing(0.0, 0.0, 0)
    x: Any = inputs
    layers = []
    for i in range(chain.num_layers):
        layer = chain.build_layers([i], 0, "meta")[0]
        params = {id(p) for p in layer.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, params: set[int] = params, saved: dict[int, int] = saved) -> torch.Tensor:
            if id(t) not in params and id(t._base) not in params:
                base = t._base if t._base is not None else t
                saved[id(base)] = base.numel() * base.element_size()
            return t

        if i > 0:
            x = tuple(torch.empty(s.shape, dtype=s.dtype, device="meta", requires_grad=s.requires_grad)
                      for s in specs[i])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call(layer, x)
            if i == chain.num_layers - 1:
                chain.loss(out, labels)
        in_bytes = sum(t.numel() * t.element_size() for t in tensors(x))
        out_bytes = sum(t.numel() * t.element_size() for t in as_tuple(out)) if i < chain.num_layers - 1 else 0
        nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        cost = LayerCost(zero, zero, zero, zero, zero, sum(saved.values()), in_bytes, out_bytes)
        ties = {}
        for (li, ni), (lj, nj) in chain.tied_parameters():
            for me, name, other in ((li, ni, lj), (lj, nj, li)):
                if me == i:
                    p = layer.get_parameter(name)
                    ties[other] = p.numel() * p.element_size()
        layers.append(LayerProfile(i, type(layer).__name__, sum(p.numel() for p in layer.parameters()), nbytes,
                                   {o: f * nbytes for o, f in STATE_FACTOR.items()}, {unit: cost}, ties))
    return Profile(chain.name, fingerprint(chain), "meta", "shapes", {}, 1, [unit], layers)

"""Post-validated optimizer steps (``--post-validate``; Zero Bubble's post-validation): every stage replica of a
worker is updated as soon as its gradients are complete (its STAGE_UPDATE action, right after its gradient sum),
optimistically, as if clipping did not engage; the worker's VALIDATE action at the end of the step then computes
the global gradient norm as the drained step does (the squared norms taken per stage before its update, summed
in one allreduce over all ranks) and decides:

* finite and clipping would not engage (or no clipping): the updates stand, bit for bit the drained step's;
* finite and clipping engages: every update is rolled back exactly (weights and optimizer state restored from
  copies taken before it) and the step redone as the drained step does it (clipped gradients, one update);
* not finite (an inf or NaN gradient anywhere): rolled back and skipped, so the weights and the optimizer state
  are those before the step; the learning-rate schedule still advances (the step counts).

The copies cost, per worker, its stage replicas' weights plus their optimizer state (AdamW and LAMB: two moments,
so three times the weight bytes; SGD: once), held from each stage's update until the end of the step.

Stepping one stage: the optimizer steps only parameters that have a gradient, so the others' gradients are set
aside for it; per-group state (LAMB's step counter) is reset to the step's start before each stage's update, so that
every stage steps from the same counter and the counter moves once per step.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from chimera.optim import clip_coefficient, grad_norms, scale_grads, sum_of_squares
from chimera.runtime.stage_state import StageKey, StageState, fill_grads

#: what VALIDATE decided: the optimistic updates stand, were redone clipped, or the step was skipped
KEPT, REDONE, SKIPPED = "kept", "redone", "skipped"


class PostValidation:
    """The per-stage updates of one worker's :class:`StageState` and their validation (module docstring)."""

    def __init__(self, stages: StageState) -> None:
        if stages.sharded is not None or stages.host is not None:
            raise ValueError("post-validated steps need every stage's optimizer state on this worker (no "
                             "--shard-optimizer, no --offload)")
        self.stages = stages
        held = {id(p) for p in stages.params}
        # each replica's parameters as the optimizer holds them (a V placement's tied ends are separate parameters)
        self.params_of: dict[StageKey, list[torch.nn.Parameter]] = {
            key: [p for p in dict.fromkeys(mod.parameters()) if id(p) in held] for key, mod in stages.modules.items()}
        self._begin()

    def _begin(self) -> None:
        self.saved: dict[StageKey, tuple[list[torch.Tensor], dict[int, dict[str, Any] | None]]] = {}
        self.norms: dict[int, torch.Tensor] = {}  # id(parameter) -> the norm of its gradient, as the update saw it
        self.groups: list[dict[str, Any]] | None = None  # the optimizer's per-group state at the step's start

    def held(self) -> list[torch.Tensor]:
        """The rollback copies held now (weights and optimizer state of the stage replicas updated in this step)."""
        return [t for weights, states in self.saved.values()
                for t in [*weights, *(v for state in states.values() if state for v in state.values()
                                      if isinstance(v, torch.Tensor))]]

    @property
    def updated_any(self) -> bool:
        """Whether a stage replica was updated in this step already."""
        return bool(self.saved)

    def update(self, key: StageKey, step: int) -> None:
        """Update stage replica ``key`` with its gradients as they are (its sum waited for), keeping what it
        replaces; the first update of the step sums the tied gradients first."""
        st, opt = self.stages, self.stages.optimizer
        if key in self.saved:
            raise RuntimeError(f"stage replica {key} updated twice in step {step}")
        if self.groups is None:
            st.sum_tied(step)
            self.groups = [_group_state(g) for g in opt.param_groups]
        else:
            _restore_groups(opt, self.groups)
        params = self.params_of[key]
        fill_grads(params)
        counted = {id(p) for p in st.norm_params}
        mine = [p for p in params if id(p) in counted]
        self.norms.update(zip(map(id, mine), grad_norms(mine, st.device)))
        self.saved[key] = ([p.detach().clone() for p in params],
                           {id(p): copy.deepcopy(opt.state[p]) if p in opt.state else None for p in params})
        st.lr = float(opt.param_groups[0]["lr"])
        _step_only(opt, params)

    def validate(self, step: int) -> tuple[float, str]:
        """The global gradient norm and what it decided (:data:`KEPT`, :data:`REDONE`, :data:`SKIPPED`); ends
        the step (LR schedule, gradients dropped)."""
        st, opt = self.stages, self.stages.optimizer
        missing = set(st.modules) - set(self.saved)
        if missing:
            raise RuntimeError(f"step {step}: no update of stage replica(s) {sorted(missing)} before the validation")
        norms = [self.norms[id(p)] for p in st.norm_params if id(p) in self.norms]
        norm = float(st.norm_allreduce(step)(sum_of_squares(norms, st.device)).sqrt())
        coef = clip_coefficient(norm, st.clip) if st.clip > 0 else None
        outcome = KEPT if math.isfinite(norm) and coef is None else REDONE if math.isfinite(norm) else SKIPPED
        if outcome != KEPT:
            self._roll_back()
            if outcome == REDONE:
                scale_grads(st.params, coef)
                opt.step()
        st.end_step(step)
        self._begin()
        return norm, outcome

    def _roll_back(self) -> None:
        """Every stage replica's weights and optimizer state as before this step's updates."""
        opt = self.stages.optimizer
        with torch.no_grad():
            for key, (weights, states) in self.saved.items():
                for p, w in zip(self.params_of[key], weights):
                    p.copy_(w)
                    if states[id(p)] is None:
                        opt.state.pop(p, None)
                    else:
                        opt.state[p] = states[id(p)]
        if self.groups is not None:
            _restore_groups(opt, self.groups)


def _group_state(group: dict[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}


def _restore_groups(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Every param group's entries as saved: changed ones put back, added ones (a counter an optimizer creates on its
    first step) removed."""
    for group, saved in zip(opt.param_groups, groups):
        for k in [k for k in group if k != "params" and k not in saved]:
            del group[k]
        group.update(copy.deepcopy(saved))


def _step_only(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """``opt.step()`` on ``params`` alone: the optimizer skips parameters without a gradient, so the others' are set
    aside while it runs."""
    ids = {id(p) for p in params}
    aside = [(p, p.grad) for g in opt.param_groups for p in g["params"] if id(p) not in ids and p.grad is not None]
    for p, _ in aside:
        p.grad = None
    try:
        opt.step()
    finally:
        for p, grad in aside:
            p.grad = grad

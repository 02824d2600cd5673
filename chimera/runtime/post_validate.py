"""Post-validated optimizer steps (``--post-validate``; Zero Bubble's post-validation): every stage replica of a
worker is updated as soon as its gradients are complete (its STAGE_UPDATE action, right after its gradient sum),
optimistically, as if clipping did not engage; the worker's VALIDATE action at the end of step j then starts the sum
of the global gradient norm (the squared norms taken per stage before its update, in one allreduce over all ranks)
and does not wait for it: the worker goes on with step j+1, whose forwards use the updated weights. The verdict is
taken at step j+1's first STAGE_UPDATE (every worker has finished step j by then, so the wait is the allreduce's
latency), and decides:

* finite and clipping would not engage (or no clipping): the updates stand, bit for bit the drained step's, and step
  j+1 goes on;
* finite and clipping engages: step j+1 runs to its end without updating (every message it posts is taken by its
  peers, who decide alike), then every update of step j is rolled back exactly (weights and optimizer state from
  the copies taken before it), step j is redone as the drained step does it (its gradients, set aside at its end,
  clipped; one update), and step j+1 runs again from its start (the same data and dropout draws);
* not finite (an inf or NaN gradient anywhere): the same, with step j skipped instead of redone, so the weights and
  the optimizer state are those before it; the learning-rate schedule still advances (the step counts).

A step that a checkpoint ends, the run's last step, and a step before :meth:`PostValidation.drain` (a save on
request) take their verdict at their own end: every checkpoint holds validated weights. So does every step after
a rollback until one is kept (:attr:`PostValidation.cautious`): where clipping engages step after step (early in
training, with a tight ``--clip-grad``) a run pays one repeated step per streak, then runs drained (the verdict
waited for at each step's end, a rollback redoing the update alone), not a repeated step each time.

The copies cost, per worker, its stage replicas' weights plus their optimizer state (AdamW and LAMB: two moments,
so three times the weight bytes; SGD: once), held from each stage's update to the verdict in the next step, and with
them the step's gradients (set aside at the step's end). A rollback costs a second run of the next step.

Stepping one stage: the optimizer steps only parameters that have a gradient, so the others' gradients are set
aside for it; per-group state (LAMB's step counter) is reset to the step's start before each stage's update, so that
every stage steps from the same counter and the counter moves once per step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from chimera.optim import clip_coefficient, grad_norms, scale_grads, sum_of_squares
from chimera.runtime.stage_state import StageKey, StageState, fill_grads

#: what the verdict decided: the optimistic updates stand, were redone clipped, or the step was skipped
KEPT, REDONE, SKIPPED = "kept", "redone", "skipped"

Saved = dict[StageKey, tuple[list[torch.Tensor], dict[int, dict[str, Any] | None]]]


@dataclass
class _Pending:
    """Step ``step``'s validation in flight: its norm's allreduce, what a rollback restores, its gradients."""

    step: int
    work: dist.Work
    squares: torch.Tensor
    saved: Saved
    groups: list[dict[str, Any]] | None
    grads: list[torch.Tensor | None]
    outcome: str = KEPT
    coef: float | None = None


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
        self.pending: _Pending | None = None  # the previous step's validation, its verdict not taken yet
        self.rerun = False  # this step's run used weights its previous step's rollback replaces: it runs again
        self.verdicts: dict[int, tuple[float, str]] = {}  # step -> (norm, outcome) since :meth:`taken`
        self.cautious = False  # the last verdict rolled a step back: the next steps drain until one is kept
        self.repeated = 0  # runs of steps repeated after a rollback (a step's second run counts one)
        self._begin()

    def _begin(self) -> None:
        self.saved: Saved = {}
        self.norms: dict[int, torch.Tensor] = {}  # id(parameter) -> the norm of its gradient, as the update saw it
        self.groups: list[dict[str, Any]] | None = None  # the optimizer's per-group state at the step's start

    def held(self) -> list[torch.Tensor]:
        """The rollback copies held now (weights and optimizer state of the stage replicas updated in this step and,
        until its verdict, in the previous one) and the previous step's gradients set aside."""
        saved = [self.saved, self.pending.saved] if self.pending else [self.saved]
        aside = [g for g in self.pending.grads if g is not None] if self.pending else []
        return [t for s in saved for weights, states in s.values()
                for t in [*weights, *(v for state in states.values() if state for v in state.values()
                                      if isinstance(v, torch.Tensor))]] + aside

    @property
    def updated_any(self) -> bool:
        """Whether a stage replica was updated (or, on a run to be repeated, skipped) in this step already."""
        return bool(self.saved) or self.rerun

    def update(self, key: StageKey, step: int) -> None:
        """Update stage replica ``key`` with its gradients as they are (its sum waited for), keeping what it
        replaces; the first update of the step takes the previous step's verdict and sums the tied gradients."""
        if self.pending is not None:
            self._verdict()
        if self.rerun:  # the weights are the previous step's optimistic ones: this run is repeated, update nothing
            return
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
        _step_only(opt, params, self.stages.step_optimizer)

    def start(self, step: int) -> None:
        """VALIDATE: start the global norm's allreduce and set the step's gradients aside; the verdict is taken by
        the next step's first update (or :meth:`drain`). Nothing on a run that is repeated."""
        if self.rerun:
            return
        st = self.stages
        missing = set(st.modules) - set(self.saved)
        if missing:
            raise RuntimeError(f"step {step}: no update of stage replica(s) {sorted(missing)} before the validation")
        norms = [self.norms[id(p)] for p in st.norm_params if id(p) in self.norms]
        squares = sum_of_squares(norms, st.device).to(st.device)
        squares, work = st.comm.allreduce_async(squares, None)
        grads = [p.grad for p in st.params]
        for p in st.params:
            p.grad = None
        self.pending = _Pending(step, work, squares, self.saved, self.groups, grads)
        self._begin()

    def _verdict(self) -> None:
        """Wait for the previous step's norm and decide; a kept step is done, another sets :attr:`rerun`."""
        pend, st = self.pending, self.stages
        assert pend is not None
        st.comm.wait(pend.work, f"global gradient norm of step {pend.step} (its verdict, in step {pend.step + 1})")
        norm = float(pend.squares.sqrt())
        pend.coef = clip_coefficient(norm, st.clip) if st.clip > 0 else None
        pend.outcome = KEPT if math.isfinite(norm) and pend.coef is None else REDONE if math.isfinite(norm) else SKIPPED
        self.verdicts[pend.step] = (norm, pend.outcome)
        self.cautious = pend.outcome != KEPT
        if pend.outcome == KEPT:
            self.pending = None
            st.lr_schedule.step()
        else:
            self.rerun = True

    def settle(self) -> bool:
        """After a step's run: where the previous step is rolled back, roll it back and redo or skip it, and
        return True (the step runs again from its start)."""
        if not self.rerun:
            return False
        self._apply()
        self._begin()
        self.rerun = False
        self.repeated += 1
        return True

    def drain(self) -> None:
        """Take the verdict of the step in flight now and apply it (nothing runs after it: no rerun)."""
        if self.pending is not None:
            self._verdict()
            if self.pending is not None:
                self._apply()
                self.rerun = False

    def taken(self) -> dict[int, tuple[float, str]]:
        """The verdicts taken since the last call, by step."""
        out, self.verdicts = self.verdicts, {}
        return out

    def _apply(self) -> None:
        """Roll the pending step back and redo it clipped, or leave it skipped; advance the LR schedule."""
        pend, st = self.pending, self.stages
        assert pend is not None and pend.outcome != KEPT
        for p in st.params:  # a repeated run's gradients
            p.grad = None
        self._roll_back(pend)
        if pend.outcome == REDONE:
            assert pend.coef is not None
            for p, g in zip(st.params, pend.grads):
                p.grad = g
            scale_grads(st.params, pend.coef)
            st.step_optimizer()
            for p in st.params:
                p.grad = None
        st.lr_schedule.step()
        self.pending = None

    def _roll_back(self, pend: _Pending) -> None:
        """Every stage replica's weights and optimizer state as before the pending step's updates."""
        opt = self.stages.optimizer
        with torch.no_grad():
            for key, (weights, states) in pend.saved.items():
                for p, w in zip(self.params_of[key], weights):
                    p.copy_(w)
                    if states[id(p)] is None:
                        opt.state.pop(p, None)
                    else:
                        opt.state[p] = states[id(p)]
        if pend.groups is not None:
            _restore_groups(opt, pend.groups)


def _group_state(group: dict[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}


def _restore_groups(opt: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Every param group's entries as saved: changed ones put back, added ones (a counter an optimizer creates on its
    first step) removed."""
    for group, saved in zip(opt.param_groups, groups):
        for k in [k for k in group if k != "params" and k not in saved]:
            del group[k]
        group.update(copy.deepcopy(saved))


def _step_only(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], step: Callable[[], Any]) -> None:
    """``step()`` (``opt``'s step) on ``params`` alone: the optimizer skips parameters without a gradient, so the
    others' are set aside while it runs."""
    ids = {id(p) for p in params}
    aside = [(p, p.grad) for g in opt.param_groups for p in g["params"] if id(p) not in ids and p.grad is not None]
    for p, _ in aside:
        p.grad = None
    try:
        step()
    finally:
        for p, grad in aside:
            p.grad = grad

"""The compute handlers: forward (F) and backward (B, or its parts I and W) of a stage replica, over one or several
micro-batches.

An F action over ``count`` micro-batches (Chimera's forward doubling, or a whole micro-batch under backward
halving) receives them as one message, runs the stage on each micro-batch in turn, stashes each for its own
backward and sends the outputs on as one message. Running the micro-batches one by one keeps every sample's
arithmetic exactly that of sequential training, whatever the schedule. With ``recompute`` the forward keeps only
its inputs, and the backward runs the forward again before differentiating. Every forward seeds the random draws
(dropout) of the layers that draw (the chain's ``draws``) from the unit (``chimera.models.stage.unit_seed``: seed,
step, micro-batch, data-parallel rank), so recomputation draws the forward's masks again and sequential training
draws the same; a stage none of whose layers draws needs no seed.

A split backward runs torch.distributed.pipelining's two halves: I differentiates with respect to the stage's
inputs only (autograd keeps the graph from where the weights' gradients branch off, and the gradients that reached
those points), W later differentiates from those points with respect to the weights and releases them. The kept
state is keyed like the stash (:class:`~chimera.runtime.step_state.Kept` in ``wkeep``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from chimera.data import Units
from chimera.job import Job
from chimera.microbatch import cat, map_tensors, split
from chimera.models import StageModule, TensorSpec, unit_seed
from chimera.offload.store import HostStore
from chimera.runtime.step_state import Kept, Slot, Stashed, StepState
from chimera.schedule import Action
from chimera.schedule.kinds import Msg, Res

try:  # the engine's entry point behind torch.autograd.backward (torch >= 2.3): differentiate
    from torch.autograd.graph import _engine_run_backward as _run_backward
except ImportError:  # pragma: no cover - a torch without it
    _run_backward = None


class StageCompute:
    """Forward and backward of the stage replicas ``modules`` of one worker."""

    def __init__(self, job: Job, modules: dict[tuple[str, int], StageModule], worker: int, dp_rank: int,
                 device: torch.device, autocast: AbstractContextManager[Any], keep_saved: bool = False,
                 store: HostStore | None = None) -> None:
        self.job = job
        self.schedule = job.schedule
        self.modules = modules
        self.worker = worker
        self.dp_rank = dp_rank
        self.device = device
        self.autocast = autocast
        self.recompute = job.run.recompute
        self.keep_saved = keep_saved  # collect autograd's saved tensors for the memory ledger
        # torch.distributed.pipelining costs ~1 s of imports: only a schedule with split backwards pays it, here
        self.split = _split_backward() if job.schedule.splits_backward else None
        # weights offloaded: saved weights become references, resolved against the copy swapped in for the backward
        self.store = store if store is not None and store.offload.weights else None
        self.wait = store.wait if store is not None else None  # a stage's swap-in (GPU copy stream)
        self.units: Units = job.units()
        # (step, pipe, micro-batch) -> data loaded in the step before (load_next)
        self.preloaded: dict[tuple[int, str, int], tuple[Any, Any]] = {}
        # per-unit mean losses summed with 1/(units x W): gradients equal those of the whole mini-batch's mean
        self.loss_scale = 1.0 / (self.schedule.microbatches * self.schedule.data_parallel)
        self.loss_seeds: dict[tuple[Any, ...], torch.Tensor] = {}  # the loss's seed gradient by its form (_loss_seed)
        self.plain = isinstance(autocast, nullcontext) and not keep_saved and self.store is None

    # -- F ------------------------------------------------------------------------------------------
    def forward(self, a: Action, st: StepState) -> None:
        """Run the forward of ``a``'s micro-batches; stash each; hand the outputs to the next stage."""
        mod = self.modules[(a.pipe, a.stage)]
        if self.wait:
            self.wait((a.pipe, a.stage))
        xs = self._inputs(a, st, mod)
        specs = self.job.stage_inputs(a.stage + 1) if not mod.is_last else []
        outs = []
        for x, mb in zip(xs, a.microbatches):
            data = (st.data.pop((a.pipe, mb), None) or self._data(a.pipe, mb, st.step)) if mod.reads_data else None
            inputs, labels = data if data is not None else (None, None)
            # a stage whose layers draw nothing needs no unit seed (StageModule.draws)
            rng = (unit_seed(self.job.run.seed, st.step, self.schedule.global_microbatch(a.pipe, mb), self.dp_rank)
                   if mod.draws else None)
            if self.recompute and not mod.is_last:
                with torch.no_grad(), self.autocast:
                    out = mod(x, inputs=inputs, labels=labels, rng=rng)
                st.stash[Slot(a.pipe, a.stage, mb)] = Stashed(x, None, data, rng)
            else:
                saved: list[torch.Tensor] = []
                if self.plain:  # no autocast, nothing saved aside: no context to enter
                    out = mod(x, inputs=inputs, labels=labels, rng=rng)
                else:
                    with self.autocast, _saving(saved if self.keep_saved else None, self.store):
                        out = mod(x, inputs=inputs, labels=labels, rng=rng)
                st.stash[Slot(a.pipe, a.stage, mb)] = Stashed(x, out, data, saved=saved)
            if mod.is_last:
                loss = out.detach().to(torch.float64)
                st.loss_sum = loss if st.loss_sum is None else st.loss_sum + loss
                st.loss_count += 1
            else:
                outs.append(tuple(_as(t.detach(), s.dtype) for t, s in zip(out, specs)))
        if outs:
            self._hand_over(Msg(Res.ACT, a.pipe, a.stage, a.microbatch), cat(outs), a.pipe, a.stage + 1, st)

    def _inputs(self, a: Action, st: StepState, mod: StageModule) -> list[tuple[torch.Tensor, ...]]:
        """Per micro-batch of ``a``, the stage's input tensors (leaves, with grad where the spec asks)."""
        if mod.is_first:
            return [()] * a.count
        got = st.inbox.pop(Msg(Res.ACT, a.pipe, a.stage - 1, a.microbatch))
        parts = split(got, a.count) if a.count > 1 else [got]
        specs = self.job.stage_inputs(a.stage)
        return [tuple(t.detach().requires_grad_(s.requires_grad) for t, s in zip(p, specs)) for p in parts]

    def data_ahead(self, segments: Sequence[Sequence[Action]]) -> dict[int, list[tuple[str, int]]]:
        """Per communication segment, the (pipe, micro-batch) units whose data the next forward after it reads (on a
        first or last stage): what :meth:`load_ahead` loads while that segment waits for its receives."""
        out: dict[int, list[tuple[str, int]]] = {}
        upcoming: list[tuple[str, int]] = []
        for k in range(len(segments) - 1, -1, -1):
            a = segments[k][0]
            if a.kind.is_p2p:
                if upcoming:
                    out[k] = upcoming
            elif Res.STASH in a.kind.spec.produces and self.modules[(a.pipe, a.stage)].reads_data:  # a forward
                upcoming = [(a.pipe, mb) for mb in a.microbatches]
        return out

    def next_step_ahead(self, segments: Sequence[Sequence[Action]]) -> tuple[int, list[tuple[str, int]]] | None:
        """The units whose data the forwards before a step's first communication segment read (on a first or last
        stage), and the step's last communication segment, which loads them for the next step while it waits
        (:meth:`load_next`): a step's first forward is on its critical path. None where there are none, or no such
        segment (a worker with no messages)."""
        comm = [k for k, seg in enumerate(segments) if seg[0].kind.is_p2p]
        if not comm:
            return None
        units = [(a.pipe, mb) for seg in segments[:comm[0]] for a in seg
                 if Res.STASH in a.kind.spec.produces and self.modules[(a.pipe, a.stage)].reads_data
                 for mb in a.microbatches]
        return (comm[-1], units) if units else None

    def load_next(self, units: Sequence[tuple[str, int]], st: StepState) -> None:
        """Load ``units``' data for the step after ``st.step`` (where the run has one), kept until that step starts
        (:meth:`start_step`)."""
        step = st.step + 1
        if step >= self.job.run.steps:
            return
        for pipe, mb in units:
            if (step, pipe, mb) not in self.preloaded:
                self.preloaded[(step, pipe, mb)] = self._data(pipe, mb, step)

    def start_step(self, st: StepState) -> None:
        """Give ``st`` the data loaded for its step in the step before (:meth:`load_next`); drop any older."""
        if self.preloaded:
            for key in [key for key in self.preloaded if key[0] <= st.step]:
                data = self.preloaded.pop(key)
                if key[0] == st.step:
                    st.data[key[1:]] = data

    def load_ahead(self, units: Sequence[tuple[str, int]], st: StepState) -> None:
        """Load ``units``' data into ``st.data`` now (the worker waits for a message), not in the forward that reads
        it, which may be on the critical path; what a recomputed forward reads again is the same data."""
        for pipe, mb in units:
            if (pipe, mb) not in st.data:
                st.data[(pipe, mb)] = self._data(pipe, mb, st.step)

    def _data(self, pipe: str, mb: int, step: int) -> tuple[Any, Any]:
        unit = self.schedule.global_microbatch(pipe, mb)
        inputs, labels = self.units.get(step, unit, self.dp_rank)
        move = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        return map_tensors(move, inputs), map_tensors(move, labels)

    # -- B, I, W -----------------------------------------------------------------------------------------
    def backward(self, a: Action, st: StepState) -> None:
        """Differentiate ``a``'s micro-batches; hand the input gradients to the previous stage."""
        self._backward(a, st, split=False)

    def backward_input(self, a: Action, st: StepState) -> None:
        """The input-gradient part (I) of a split backward: gradients with respect to the stage's inputs only, handed
        to the previous stage; what the weight gradients need is kept for :meth:`backward_weight`."""
        self._backward(a, st, split=True)

    def backward_weight(self, a: Action, st: StepState) -> None:
        """The weight-gradient part (W): accumulate the weights' gradients from what I kept, then release it."""
        mod = self.modules[(a.pipe, a.stage)]
        for mb in a.microbatches:
            kept = st.wkeep.pop(Slot(a.pipe, a.stage, mb))
            if kept.groups is None:
                differentiate(kept.outputs, kept.grads)
            else:
                assert self.split is not None
                self.split.stage_backward_weight(mod.parameters(), kept.groups)

    def _backward(self, a: Action, st: StepState, split: bool) -> None:
        mod = self.modules[(a.pipe, a.stage)]
        if self.wait:
            self.wait((a.pipe, a.stage))
        grads = self._output_grads(a, st, mod)
        in_specs = self.job.stage_inputs(a.stage)
        out_specs = self.job.stage_inputs(a.stage + 1) if not mod.is_last else []
        sent = []
        for g, mb in zip(grads, a.microbatches):
            slot = Slot(a.pipe, a.stage, mb)
            saved = st.stash.pop(slot)
            out = saved.output if saved.output is not None else self._recompute(mod, saved)
            if self.store:  # weights in packs: the last one in before the backward
                self.store.backward_packs((a.pipe, a.stage))
            if mod.is_last:  # the loss scaled through its seed gradient: no multiply, no node for it
                outs, out_grads = [out], [self._loss_seed(out)]
            else:
                pairs = [(t, gt) for t, gt in zip(out, _fill(g, out_specs)) if gt is not None and t.requires_grad]
                outs, out_grads = [t for t, _ in pairs], [_as(gt, t.dtype) for t, gt in pairs]
            if not split:
                differentiate(outs, out_grads)
            else:
                st.wkeep[slot] = self._input_gradients(mod, saved, outs, out_grads)
            if self.store:
                self.store.release_packs((a.pipe, a.stage))
            if not mod.is_first:
                sent.append(tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                  for t, s in zip(saved.inputs, in_specs) if s.requires_grad))
        if sent:
            self._hand_over(Msg(Res.GRAD, a.pipe, a.stage, a.microbatch), cat(sent), a.pipe, a.stage - 1, st)

    def _loss_seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a unit's loss is differentiated with: ``loss_scale`` in the loss's shape, dtype and device
        (the gradient ``loss * loss_scale`` would pass to the loss), made once per such form and only read by
        autograd (a gradient it does not own is copied, never stolen)."""
        key = (loss.shape, loss.dtype, loss.device)
        seed = self.loss_seeds.get(key)
        if seed is None:
            seed = self.loss_seeds[key] = torch.full_like(loss, self.loss_scale)
        return seed

    def _input_gradients(self, mod: StageModule, saved: Stashed, outs: list[torch.Tensor],
                         out_grads: list[torch.Tensor] | None) -> Kept:
        """Gradients into the inputs' ``.grad`` (torch.distributed.pipelining's input-only backward, which keeps
        the graph from the weights' branch points on); where no input needs one, everything is left to W."""
        inputs = [t for t in saved.inputs if t.requires_grad]
        if not inputs:
            return Kept(None, outs, out_grads, saved.saved)
        outs = [t.clone() if t._is_view() else t for t in outs]  # torch detaches the outputs in place: no views
        assert self.split is not None
        _, groups = self.split.stage_backward_input(outs, out_grads, inputs, mod.parameters())
        return Kept(groups, [], None, saved.saved)

    def _output_grads(self, a: Action, st: StepState, mod: StageModule) -> list[tuple[torch.Tensor, ...]]:
        if mod.is_last:
            return [()] * a.count
        got = st.inbox.pop(Msg(Res.GRAD, a.pipe, a.stage + 1, a.microbatch))
        return split(got, a.count) if a.count > 1 else [got]

    def _recompute(self, mod: StageModule, saved: Stashed) -> Any:
        """The forward again, with grad, under the unit's seed it first ran under (the same dropout masks)."""
        inputs, labels = saved.data if saved.data is not None else (None, None)
        with self.autocast, _saving(None, self.store):
            return mod(saved.inputs or None, inputs=inputs, labels=labels, rng=saved.rng)

    def _hand_over(self, msg: Msg, tensors: tuple[torch.Tensor, ...], pipe: str, to_stage: int, st: StepState
                   ) -> None:
        """Into the inbox when ``to_stage`` lives on this worker, else into the outbox for its send action."""
        if self.schedule.placement[(pipe, to_stage)] == self.worker:
            st.inbox[msg] = tensors
        else:
            st.outbox[msg] = tuple(t.contiguous() for t in tensors)


def _saving(into: list[torch.Tensor] | None, store: HostStore | None = None) -> AbstractContextManager[Any]:
    """Record the tensors autograd saves for the backward into ``into``; with ``store`` (weights offloaded) save
    device weights as references (nothing when both are None)."""
    if into is None and store is None:
        return nullcontext()

    def pack(t: torch.Tensor) -> Any:
        ref = store.pack(t) if store is not None else t
        if into is not None and ref is t:
            into.append(t)
        return ref

    return torch.autograd.graph.saved_tensors_hooks(pack, HostStore.unpack if store is not None else lambda t: t)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call where it is a no-op (~0.7 µs a tensor)."""
    return t if t.dtype == dtype else t.to(dtype)


def differentiate(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward(outputs, grads)``: the same engine call, without the Python checks in front of it.

    Those checks (the gradients' shapes against the outputs', tensor subclasses' overrides) cost 10-13 µs a
    backward, on the critical path of every step. The engine checks every gradient's shape, dtype and device against
    its output itself before it runs; only plain tensors take this path (a subclass, or a torch without the engine
    entry point, goes through ``torch.autograd.backward``).
    """
    if _run_backward is None or any(type(t) is not torch.Tensor for t in (*outputs, *grads)):
        torch.autograd.backward(outputs, grads)
    elif outputs:
        _run_backward(tuple(outputs), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _fill(grads: tuple[torch.Tensor, ...], specs: Sequence[TensorSpec]) -> list[torch.Tensor | None]:
    """The received gradients placed at the outputs that carry one (those whose spec requires grad)."""
    it = iter(grads)
    return [next(it) if s.requires_grad else None for s in specs]


def _split_backward() -> Any:
    """torch.distributed.pipelining's input-only and weight-only backward (``stage_backward_input`` and
    ``stage_backward_weight``)."""
    from torch.distributed.pipelining import _backward

    return _backward

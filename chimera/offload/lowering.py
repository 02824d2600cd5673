"""The offload lowering pass: the swap actions of a policy, added to a lowered schedule.

    lowered = lower(compute_only, Offload.parse("everything", prefetch=1))

Every swap action is placed by its own stage's policy (a stage kept on the device gets none):

* gradients offloaded: GRAD_OUT right after every backward part that makes weight gradients (so before the stage's
  gradient sum starts; with weights in packs each gradient has already left as the backward made it); else, where the optimizer state is offloaded, GRAD_OUT of every stage replica before the
  optimizer step (the step runs on the host's copies);
* optimizer state offloaded, weights kept on the device: SWAP_IN of every stage replica after the step (the
  updated weights);
* weights offloaded (whole stages): before compute action n (and its receives), SWAP_IN of the stages that actions
  n..n+prefetch use and the device lacks (each by its own stage's prefetch); right after it, SWAP_OUT of its stage
  unless one of the next max(1, prefetch) compute actions uses it;
* weights in packs (``StageOffload.pack``): no SWAP_IN/SWAP_OUT; the packs move inside the stage's compute actions
  (:mod:`chimera.offload.packs`), priced in their cost and memory.
"""

from __future__ import annotations

from chimera.offload.policy import Offload
from chimera.schedule.ir import Action, Schedule, _replace
from chimera.schedule.kinds import SPECS, Kind, Res
from chimera.schedule.lowering import lower as lower_comm
from chimera.schedule.lowering import post_validate


def add_offload(schedule: Schedule, offload: Offload) -> Schedule:
    """Insert the swap actions of ``offload`` into a lowered schedule (module docstring)."""
    offload.check(schedule.stages)
    if not offload.optimizer:
        return schedule
    return _replace(schedule, actions=[_offload_row(row, offload) for row in schedule.actions])


def _swaps_around_compute(row: tuple[Action, ...], offload: Offload
                          ) -> tuple[dict[int, list[Action]], dict[int, list[Action]], list[tuple[str, int]]]:
    """The swaps to insert before and after each compute action, and the (pipe, stage) each compute action uses."""
    compute = [i for i, a in enumerate(row) if a.kind.is_compute]
    uses = [(row[i].pipe, row[i].stage) for i in compute]
    horizon = max((s.prefetch for s in offload.stages), default=0)
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    resident: set[tuple[str, int]] = set()
    for n, i in enumerate(compute):
        start = i
        while start > 0 and row[start - 1].kind.is_p2p:
            start -= 1  # before the receives: never split a communication batch
        end = i + 1  # right after the compute: its sends may share a batch with the next one's receives
        for ahead, key in enumerate(uses[n:n + horizon + 1]):
            policy = offload.at(key[1])
            if (policy.level.weights and not policy.packed and ahead <= policy.prefetch
                    and key not in resident):
                resident.add(key)
                before.setdefault(start, []).append(Action(Kind.SWAP_IN, *key))
        a = row[i]
        mine = offload.at(a.stage)
        if mine.level.gradients and Res.WGRAD in SPECS[a.kind].produces:
            after.setdefault(end, []).append(Action(Kind.GRAD_OUT, a.pipe, a.stage))
        if mine.level.weights and not mine.packed and uses[n] not in uses[n + 1:n + max(1, mine.prefetch) + 1]:
            resident.discard(uses[n])
            after.setdefault(end, []).append(Action(Kind.SWAP_OUT, *uses[n]))
    return before, after, uses


def _offload_row(row: tuple[Action, ...], offload: Offload) -> list[Action]:
    before, after, uses = _swaps_around_compute(row, offload)
    out: list[Action] = []
    for i, a in enumerate(row):
        out += after.get(i, []) + before.get(i, [])
        if a.kind is Kind.OPTIMIZER_STEP:  # the step runs on the host's copies
            held = [(p, s) for p, s in sorted(dict.fromkeys(uses)) if offload.optimizer_at(s)]
            out += [Action(Kind.GRAD_OUT, p, s) for p, s in held if not offload.gradients_at(s)]
            out += [a] + [Action(Kind.SWAP_IN, p, s) for p, s in held if not offload.weights_at(s)]
            continue
        out.append(a)
    out += after.get(len(row), [])
    return out


def lower(schedule: Schedule, offload: Offload | None = None, post_validated: bool = False) -> Schedule:
    """All lowering passes: p2p, gradient sync, optimizer step, then the swaps of ``offload`` if given; with
    ``post_validated`` the optimizer step split into per-stage updates and a validation last
    (:func:`chimera.schedule.lowering.post_validate`; ValueError with an offload that moves the optimizer state)."""
    lowered = lower_comm(schedule)
    if post_validated and offload is not None and offload.optimizer:
        raise ValueError(f"post-validated steps keep every stage's optimizer state on the device, but --offload "
                         f"{offload.text} moves it to the host: drop one")
    lowered = add_offload(lowered, offload) if offload is not None else lowered
    return post_validate(lowered) if post_validated else lowered

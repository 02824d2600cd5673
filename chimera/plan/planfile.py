"""The plan file: the configuration the planner chose, with its predictions, for a run to train exactly that.

    plan = PlanFile.load("profiles/bert-tiny.plan.json")
    plan.flags        # schedule, D, W, B, N, recompute, offload, partition: what --plan FILE trains
    plan.trust        # "" or why its predictions may be off (how the profile was taken; plan.profiles.trust_note)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chimera.plan.candidate import Evaluated, PlanResult
from chimera.profile.format import fingerprint

PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan file that is missing, malformed or made for another model; says what to do."""


@dataclass(frozen=True)
class PlanFile:
    """The chosen configuration (training flags) and what the simulator predicted for it."""

    model: str
    fingerprint: str
    device: str
    workers: int
    global_batch: int
    memory_limit: int | None
    flags: dict[str, Any]
    predicted_step_s: float
    predicted_samples_per_s: float
    predicted_bubble: float
    peak_memory_bytes: int
    version: int = PLAN_VERSION
    ranked: list[dict[str, Any]] = field(default_factory=list)  # the runners-up, for the record
    trust: str = ""  # why the predictions may be off ("": the profile was taken as the workers will run)
    tokens_per_sample: int | None = None  # the model's sequence length when planned (None: not token sequences)
    clip_grad: float | None = None  # the --clip-grad the optimizer steps were priced with (None: not recorded)
    post_validate: bool | None = None  # whether the rollback copies of --post-validate were priced (None: not recorded)

    @staticmethod
    def from_result(result: PlanResult, model: str, fingerprint: str, device: str, keep: int = 10,
                    trust: str = "", tokens_per_sample: int | None = None, clip_grad: float | None = None,
                    post_validate: bool | None = None) -> PlanFile:
        """The best candidate of ``result`` as a plan (PlanError when nothing fits); ``trust``: :attr:`trust`."""
        if not result.ranked:
            reasons = sorted({e.reason for e in result.infeasible if e.reason})[:5]
            raise PlanError(f"no configuration of {model} fits on {result.inputs.get('workers')} workers: "
                            + "; ".join(reasons))
        best = result.ranked[0]
        return PlanFile(model, fingerprint, device, result.inputs["workers"], result.inputs["global_batch"],
                    result.inputs.get("memory_limit"), plan_flags(best), float(best.step_s or 0.0),
                    float(best.samples_per_s or 0.0), float(best.bubble or 0.0), int(best.peak_memory or 0),
                    ranked=[summary(e) for e in result.ranked[:keep]], trust=trust,
                    tokens_per_sample=tokens_per_sample, clip_grad=clip_grad, post_validate=post_validate)

    def trust_for(self, clip_grad: float, post_validate: bool = False) -> str:
        """:attr:`trust`, and whether a run with ``clip_grad`` clips where the plan priced it (or the reverse), and
        whether it post-validates where the plan did not price it."""
        notes = [self.trust] if self.trust else []
        if post_validate and not self.post_validate:
            notes.append("the plan's memory has no --post-validate rollback copies (the memory verdict counts them): "
                         "plan with --post-validate for its peak")
        if self.clip_grad is not None and (self.clip_grad > 0) != (clip_grad > 0):
            priced = "clipping by the global gradient norm" if self.clip_grad > 0 else "no clipping"
            notes.append(f"the plan priced {priced} and this run has --clip-grad {clip_grad:g}: plan with "
                         f"--clip-grad {clip_grad:g} for its step time")
        return "; ".join(notes)

    def check_model(self, chain: Any) -> None:
        """PlanError unless the plan was made for ``chain``: its name, and its layers and the shapes between them
        (the profile's fingerprint: a plan's timings are of those shapes)."""
        if chain.name != self.model:
            raise PlanError(f"the plan is for model {self.model}, not {chain.name}; plan this model with chimera plan")
        if fingerprint(chain) == self.fingerprint:  # as Profile.check compares a profile with the chain
            return
        tokens = chain.tokens_per_sample()
        if self.tokens_per_sample is not None and tokens is not None and tokens != self.tokens_per_sample:
            raise PlanError(f"the plan was made for {self.model} at {self.tokens_per_sample} tokens per sample and "
                            f"this run has {tokens}: train with --seq-len {self.tokens_per_sample}, or profile and "
                            f"plan again with --seq-len {tokens}")
        raise PlanError(f"the plan was made for a {self.model} whose layers or the shapes between them differ from "
                        "this run's (another --seq-len, --vocab-shards or model definition); profile and plan again "
                        "with the model flags you train with")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @staticmethod
    def load(path: str | Path) -> PlanFile:
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"no plan at {path}; make one with chimera plan --model NAME --profile P --workers K -o "
                            f"{path}, or pass --plan auto")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"{path} is not JSON ({e}); make the plan again with chimera plan") from None
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"{path}: plan format {d.get('version')} is not {PLAN_VERSION}; make it again")
        try:
            return PlanFile(**d)
        except TypeError as e:
            raise PlanError(f"{path}: malformed plan ({e}); make it again with chimera plan") from None


def plan_flags(e: Evaluated) -> dict[str, Any]:
    """Training flags of an evaluated candidate, its partition included."""
    flags = e.candidate.flags()
    if e.partition:
        flags["partition"] = ",".join(map(str, e.partition))
    return flags


def summary(e: Evaluated) -> dict[str, Any]:
    """One candidate as a JSON-ready record."""
    return {**plan_flags(e), "label": e.candidate.label, "step_s": e.step_s, "samples_per_s": e.samples_per_s,
            "bubble": e.bubble, "peak_memory_bytes": e.peak_memory, "reason": e.reason}

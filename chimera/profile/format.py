"""The profile file: per-layer costs and bytes at several micro-batch sizes, and the cluster's communication.

A profile is what the planner reads (``chimera plan``); ``chimera profile`` writes one (versioned JSON). It
records how it was taken (device, dtype, library versions, threads per process, processes at once) and a fingerprint of the model, so a
profile of another model, device or library version is refused with a message instead of planning on stale
numbers::

    prof = Profile.load("profiles/bert-tiny.profile.json")
    prof.check(chain, device="cpu")          # ProfileError if it does not describe this model here
    cost = prof.stage(range(0, 3), micro_batch_size=4)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile that is missing, malformed, stale or taken for another model/device; says what to do."""


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one operation: median and spread (75th minus 25th percentile), seconds."""

    median_s: float
    spread_s: float = 0.0
    reps: int = 1


@dataclass(frozen=True)
class LayerCost:
    """One layer at one micro-batch size.

    Attributes:
        forward: the forward with autograd recording.
        backward_input: gradients with respect to the layer's inputs only (the critical path of a split backward).
        backward_weight: gradients with respect to its parameters only.
        backward: the full backward (inputs and parameters).
        recompute: what a recomputing backward adds: the forward again, with autograd recording.
        stash_bytes: bytes the autograd graph keeps for the backward (saved tensors, parameters excluded).
        input_bytes: bytes of the layer's inputs (what a recomputing stage keeps instead).
        output_bytes: bytes of the layer's outputs (sent on when the layer ends a stage).
    """

    forward: Timing
    backward_input: Timing
    backward_weight: Timing
    backward: Timing
    recompute: Timing
    stash_bytes: int
    input_bytes: int
    output_bytes: int


@dataclass(frozen=True)
class LayerProfile:
    """One layer: its parameters and optimizer state, and its cost at every profiled micro-batch size."""

    index: int
    kind: str
    params: int
    param_bytes: int
    optimizer_bytes: dict[str, int]  # optimizer name -> state bytes it keeps for this layer
    costs: dict[int, LayerCost]  # micro-batch size -> cost
    tied: dict[int, int] = field(default_factory=dict)  # other layer -> bytes of the parameter they share
    optimizer_s: dict[str, float] = field(default_factory=dict)  # optimizer name -> seconds of its step here


@dataclass(frozen=True)
class Link:
    """A communication cost model: ``latency_s + bytes / bandwidth_Bps``."""

    latency_s: float
    bandwidth_Bps: float

    def time(self, nbytes: float) -> float:
        return self.latency_s + (nbytes / self.bandwidth_Bps if self.bandwidth_Bps else 0.0)


@dataclass(frozen=True)
class CommProfile:
    """Point-to-point and allreduce costs measured between the workers that will train.

    ``allreduce[n]``: a SUM allreduce over n ranks (its bandwidth term counts the bytes of the buffer reduced).
    ``where`` says how it was measured (e.g. ``"ray: 2 nodes, 4 workers"`` or ``"local gloo, 2 processes"``).
    """

    p2p: Link
    allreduce: dict[int, Link]
    backend: str
    where: str


@dataclass(frozen=True)
class Profile:
    """Everything the planner needs to know about a model on a device (module docstring)."""

    model: str
    fingerprint: str
    device: str
    dtype: str
    versions: dict[str, str]
    threads: int
    micro_batch_sizes: list[int]
    layers: list[LayerProfile]
    max_micro_batch_size: int | None = None  # largest that fits on the device (None: not probed)
    device_memory_bytes: int | None = None
    comm: CommProfile | None = None
    host_in: Link | None = None  # host -> device copies (offload's swap-in), from pinned memory on GPU
    host_out: Link | None = None  # device -> host copies (offload's gradient swap-out)
    created: str = ""
    version: int = PROFILE_VERSION
    notes: list[str] = field(default_factory=list)
    concurrent: int = 1  # processes profiled at once, in lock-step (``--concurrent``; files without it: 1)
    actions: dict[str, float] = field(default_factory=dict)  # the runtime's fixed s per action, by kind ({}: none)
    step_s: float = 0.0  # the runtime's own s per step beyond its actions (chimera.calibrate.step_remainder; 0: none)

    def __post_init__(self) -> None:
        if not isinstance(self.concurrent, int) or self.concurrent < 1:
            raise ProfileError(f"profile field concurrent must be an integer >= 1, got {self.concurrent!r}; take "
                               "the profile again with chimera profile")
        if isinstance(self.step_s, bool) or not isinstance(self.step_s, int | float) or not self.step_s >= 0:
            raise ProfileError(f"profile field step_s must be seconds >= 0, got {self.step_s!r}; take the profile "
                               "again with chimera profile --comm local")

    # -- reading --------------------------------------------------------------------------------------
    def cost(self, layer: int, micro_batch_size: int) -> LayerCost:
        """One layer's cost at a profiled micro-batch size (ProfileError names the profiled sizes otherwise)."""
        costs = self.layers[layer].costs
        if micro_batch_size not in costs:
            raise ProfileError(f"micro-batch size {micro_batch_size} was not profiled (profiled: "
                               f"{sorted(costs)}); profile it with chimera profile --micro-batch-sizes")
        return costs[micro_batch_size]

    def stage_seconds(self, layers: Iterable[int], micro_batch_size: int) -> dict[str, float]:
        """Summed median seconds of ``layers`` at one micro-batch size: forward, backward (full, input, weight),
        recompute."""
        out = dict.fromkeys(("forward", "backward", "backward_input", "backward_weight", "recompute"), 0.0)
        for i in layers:
            c = self.cost(i, micro_batch_size)
            for k in out:
                out[k] += getattr(c, k).median_s
        return out

    def tied_apart(self, layers: Sequence[int]) -> int:
        """Bytes of the tied parameters among ``layers`` whose other end lies outside them (summed apart)."""
        here = set(layers)
        return sum(b for i in layers for j, b in self.layers[i].tied.items() if j not in here)

    def tied_within(self, layers: Sequence[int]) -> list[tuple[int, int]]:
        """(layer, bytes) of every tied pair with both ends among ``layers``, named by its later end: one parameter
        there (one gradient, one optimizer state), which both layers' counts list."""
        pairs = [(i, j, b) for i in layers for j, b in self.layers[i].tied.items()]
        if not pairs:  # (the planner asks for every stage of every candidate)
            return []
        here = set(layers)
        return sorted((i, b) for i, j, b in pairs if j in here and j < i)

    # -- files ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for layer in d["layers"]:
            layer["costs"] = {str(k): v for k, v in layer["costs"].items()}
            layer["tied"] = {str(k): v for k, v in layer["tied"].items()}
        if d["comm"] is not None:
            d["comm"]["allreduce"] = {str(k): v for k, v in d["comm"]["allreduce"].items()}
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Profile:
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile format version {d.get('version')} is not {PROFILE_VERSION}, the one this "
                               "chimera reads; take the profile again with chimera profile")
        try:
            layers = [LayerProfile(x["index"], x["kind"], x["params"], x["param_bytes"], dict(x["optimizer_bytes"]),
                                   {int(k): _layer_cost(v) for k, v in x["costs"].items()},
                                   {int(k): v for k, v in x.get("tied", {}).items()},
                                   dict(x.get("optimizer_s", {}))) for x in d["layers"]]
            comm = d.get("comm")
            if comm is not None:
                comm = CommProfile(Link(**comm["p2p"]), {int(k): Link(**v) for k, v in comm["allreduce"].items()},
                                   comm["backend"], comm["where"])
            fields = {k: v for k, v in d.items() if k not in ("layers", "comm", "host_in", "host_out")}
            links = {k: Link(**d[k]) for k in ("host_in", "host_out") if d.get(k) is not None}
            return Profile(**fields, layers=layers, comm=comm, **links)
        except (KeyError, TypeError) as e:
            raise ProfileError(f"malformed profile: {type(e).__name__}: {e}; take it again with chimera profile"
                               ) from None

    @staticmethod
    def load(path: str | Path) -> Profile:
        path = Path(path)
        if not path.is_file():
            raise ProfileError(f"no profile at {path}; take one with chimera profile --model NAME -o {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path} is not JSON ({e}); take the profile again with chimera profile") from None
        return Profile.from_dict(d)

    def check(self, chain: Any, device: str | None = None, versions: dict[str, str] | None = None) -> Profile:
        """Raise :class:`ProfileError` unless this profile describes ``chain`` (on ``device``, with ``versions``)."""
        if self.fingerprint != fingerprint(chain):
            raise ProfileError(f"the profile was taken for {self.model} with other layers than {chain.name} has now "
                               "(layer count, parameters or shapes differ: another --seq-len or --vocab-shards?); "
                               "profile again with the model flags you train with")
        if device is not None and self.device.split(":")[0] != device.split(":")[0]:
            raise ProfileError(f"the profile was taken on {self.device}, not {device}; profile on the device that "
                               "will train")
        stale = {k: (v, self.versions.get(k)) for k, v in (versions or {}).items() if self.versions.get(k) != v}
        if stale:
            diff = ", ".join(f"{k} {old} -> {new}" for k, (new, old) in stale.items())
            raise ProfileError(f"the profile was taken with other library versions ({diff}); profile again")
        return self


def _layer_cost(d: dict[str, Any]) -> LayerCost:
    timings = {k: Timing(**d[k]) for k in ("forward", "backward_input", "backward_weight", "backward", "recompute")}
    return LayerCost(**timings, stash_bytes=d["stash_bytes"], input_bytes=d["input_bytes"],
                     output_bytes=d["output_bytes"])


def fingerprint(chain: Any) -> str:
    """The chain's fingerprint (:meth:`chimera.models.LayerChain.fingerprint`): what a profile depends on."""
    return chain.fingerprint()

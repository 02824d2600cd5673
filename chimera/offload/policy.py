"""Offload policies, typed: what each stage keeps in host memory, in packs of how many layers, how far ahead.

    off = Offload.parse("everything,none", prefetch=1)     # the flag's form, read in one place
    off.at(0).level is EVERYTHING, off.weights_at(1)        # (True, False)
    [lv.name for lv in ladder()]                           # least offload first, by what each level moves

A level is one registry entry (:func:`register_level`): the memory model, the lowering, the costs and the host
store read its three switches (optimizer state, gradients, weights in host memory), never its name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    """What one stage keeps in host memory instead of on the device."""

    name: str
    optimizer: bool  # the optimizer state (the step runs on the host's copy of the weights)
    gradients: bool  # the gradients: moved out after every backward, summed over host buffers
    weights: bool  # the weights: on the device only from their swap-in to their swap-out
    help: str = ""

    @property
    def amount(self) -> int:
        """How much lives on the host: the ladder's order (less first)."""
        return int(self.optimizer) + int(self.gradients) + int(self.weights)


LEVELS: dict[str, Level] = {}


def register_level(level: Level) -> Level:
    """Add a level; its name is what ``--offload`` takes."""
    if level.weights and not level.gradients or level.gradients and not level.optimizer:
        raise ValueError(f"offload level {level.name!r}: weights on the host need the gradients there, and gradients "
                         "the optimizer state")
    LEVELS[level.name] = level
    return level


NONE = register_level(Level("none", False, False, False, "everything on the device"))
OPTIMIZER = register_level(Level("optimizer", True, False, False, "the optimizer state in host memory"))
GRADIENTS = register_level(Level("optimizer+gradients", True, True, False, "also the gradients"))
EVERYTHING = register_level(Level("everything", True, True, True, "also the weights, swapped in before use"))


def ladder() -> list[Level]:
    """Every level, least offload first (ties by name): the order ``--offload auto`` and the planner try them."""
    return sorted(LEVELS.values(), key=lambda lv: (lv.amount, lv.name))


def level(name: str) -> Level:
    """The level called ``name``; ValueError lists the known ones."""
    if name not in LEVELS:
        raise ValueError(f"offload policy must be one of {', '.join(lv.name for lv in ladder())} (one for all "
                         f"stages, or a comma list with one per stage), got {name!r}")
    return LEVELS[name]


@dataclass(frozen=True)
class StageOffload:
    """One stage's policy: its level, weights swapped in packs of ``pack`` layers inside its compute (0: whole
    stage, by swap actions), swapped in ``prefetch`` compute actions before use."""

    level: Level = NONE
    pack: int = 0
    prefetch: int = 1

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {self.prefetch}")
        if self.pack < 0:
            raise ValueError(f"pack size must be >= 0 layers (0: whole stages), got {self.pack}")

    @property
    def packed(self) -> bool:
        """Weights move in packs inside the stage's compute actions (no swap actions of their own)."""
        return self.pack > 0 and self.level.weights

    def describe(self) -> str:
        """The level, and for weights how they move, with the flag that chooses it: ``everything (whole stages,
        --prefetch 1)`` or ``everything (packs of 2 layers, --offload-pack 2)`` (a pack prefetches the next)."""
        text = self.level.name
        if self.level.weights:
            text += (f" (packs of {self.pack} layer{'s' if self.pack > 1 else ''}, --offload-pack {self.pack})"
                     if self.pack else f" (whole stages, --prefetch {self.prefetch})")
        return text


@dataclass(frozen=True)
class Offload:
    """The offload policy of a pipeline: one :class:`StageOffload` for every stage, or one for all stages.

    Both replicas of a stage (Chimera's two pipes) follow that stage's policy.
    """

    stages: tuple[StageOffload, ...] = (StageOffload(),)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("an offload policy needs at least one stage's policy")

    @staticmethod
    def uniform(lv: Level = NONE, prefetch: int = 1, pack: int = 0) -> Offload:
        """The same policy for every stage."""
        return Offload((StageOffload(lv, pack, prefetch),))

    @staticmethod
    def of(levels: Sequence[Level], prefetch: int = 1, pack: int = 0) -> Offload:
        """One level per stage (or one for all), the same prefetch and pack size."""
        return Offload(tuple(StageOffload(lv, pack, prefetch) for lv in levels))

    @staticmethod
    def parse(text: str, prefetch: int = 1, pack: int = 0) -> Offload:
        """The flag's form: ``everything`` or ``everything,optimizer,none,none`` (ValueError naming what is wrong)."""
        return Offload.of([level(p.strip()) for p in text.split(",")], prefetch, pack)

    def check(self, stages: int) -> None:
        """ValueError unless it has one policy for all stages or exactly one per each of ``stages`` stages."""
        if len(self.stages) not in (1, stages):
            raise ValueError(f"the offload policy lists {len(self.stages)} policies ({self.text}) for a pipeline "
                             f"of {stages} stages: give one policy for all stages or exactly {stages}, one per stage")

    def at(self, stage: int) -> StageOffload:
        """Stage ``stage``'s policy."""
        return self.stages[0] if len(self.stages) == 1 else self.stages[stage]

    def optimizer_at(self, stage: int) -> bool:
        return self.at(stage).level.optimizer

    def gradients_at(self, stage: int) -> bool:
        return self.at(stage).level.gradients

    def weights_at(self, stage: int) -> bool:
        return self.at(stage).level.weights

    def packed_at(self, stage: int) -> bool:
        """Stage ``stage``'s weights move in packs inside its compute actions."""
        return self.at(stage).packed

    @property
    def optimizer(self) -> bool:
        """Some stage keeps its optimizer state on the host."""
        return any(s.level.optimizer for s in self.stages)

    @property
    def gradients(self) -> bool:
        """Some stage offloads its gradients."""
        return any(s.level.gradients for s in self.stages)

    @property
    def weights(self) -> bool:
        """Some stage offloads its weights."""
        return any(s.level.weights for s in self.stages)

    @property
    def moving(self) -> StageOffload | None:
        """The first stage whose weights move (its prefetch depth and pack size are every moving stage's), or None."""
        return next((s for s in self.stages if s.level.weights), None)

    @property
    def uniform_level(self) -> bool:
        return len({s.level for s in self.stages}) == 1

    @property
    def text(self) -> str:
        """The flag's form (levels only): ``everything`` or ``everything,none``."""
        return ",".join(s.level.name for s in self.stages)

    def describe(self) -> str:
        """In words, stage by stage (one phrase when every stage is alike)."""
        if len(set(self.stages)) == 1:
            return self.stages[0].describe()
        return "; ".join(f"stage {i}: {s.describe()}" for i, s in enumerate(self.stages))

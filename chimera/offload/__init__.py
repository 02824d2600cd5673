"""Offload as one component: the typed per-stage policy (:mod:`.policy`), its lowering pass (:mod:`.lowering`),
its costs (:mod:`.costs`), and the runtime's host store and weight packs (:mod:`.store`, :mod:`.packs`, which
import torch and are not loaded here). The memory effect of each swap action is a column of the action-kinds
table (``chimera.schedule.kinds``).

    from chimera.offload import Offload, ladder
    Offload.parse("everything,none", prefetch=1).describe()   # 'stage 0: everything (whole stages, --prefetch 1); stage 1: none'
"""

from chimera.offload.policy import (
           EVERYTHING,
           GRADIENTS,
           LEVELS,
           NONE,
           OPTIMIZER,
           Level,
           Offload,
           StageOffload,
           ladder,
           level,
           register_level,
)

__all__ = ["EVERYTHING", "GRADIENTS", "LEVELS", "NONE", "OPTIMIZER", "Level", "Offload", "StageOffload", "ladder",
           "level", "register_level"]

"""Profiles of models (per layer, per micro-batch size) and of the cluster's communication, for the planner."""

from chimera.profile.format import (
    PROFILE_VERSION,
    CommProfile,
    LayerCost,
    LayerProfile,
    Link,
    Profile,
    ProfileError,
    Timing,
    fingerprint,
)

__all__ = ["PROFILE_VERSION", "CommProfile", "LayerCost", "LayerProfile", "Link", "Profile", "ProfileError", "Timing",
           "fingerprint"]

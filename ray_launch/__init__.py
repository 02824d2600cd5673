"""Ray driver, actors and cluster configuration for chimera."""

"""chimera: Chimera bidirectional pipelines on Ray."""

__version__ = "0.1.0"

"""The delay model with 20 ms blocks, as a ``--chain`` factory for the plan-accuracy test (``chimera plan`` has no
model overrides): four sleeping blocks whose forward sleeps 20 ms and backward 40 ms (20 ms input gradient, 20 ms
weight gradient), so the compute of every stage is known."""

from chimera.models import LayerChain, build_model


def delay_20ms() -> LayerChain:
    """Embedding, four 20 ms blocks, head."""
    return build_model("delay", num_blocks=4, fwd_s=0.02)

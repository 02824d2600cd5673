"""Split backward (I + W) trains exactly what sequential training does: every new schedule at D in {2, 4},
N in {D, 2D}, with data parallelism, recomputation, tied weights (GPT-2), Chimera's two replicas and the four
of four-pipe Chimera."""

import pytest
from test_runtime_parity import BASE, SGD, assert_parity

CASES = {
    "zb-h1-D2N2-W2": dict(schedule="zb-h1", stages=2, micro_batches=2, data_parallel=2, **SGD),
    "zb-h1-D4N8-gpt2": dict(schedule="zb-h1", stages=4, micro_batches=8, model="gpt2-tiny"),
    "zb-h2-D2N4-recompute": dict(schedule="zb-h2", stages=2, micro_batches=4, recompute=True),
    "zb-h2-D4N4-gpt2-W2": dict(schedule="zb-h2", stages=4, micro_batches=4, model="gpt2-tiny", data_parallel=2),
    "chimera-split-D2N2-gpt2-W2": dict(schedule="chimera", split_backward=True, stages=2, micro_batches=2,
                                       model="gpt2-tiny", data_parallel=2, **SGD),
    "chimera-split-D4N4-recompute": dict(schedule="chimera", split_backward=True, stages=4, micro_batches=4,
                                         recompute=True, model="gpt2-tiny"),
    "chimera-split-D4N8-halving": dict(schedule="chimera", split_backward=True, stages=4, micro_batches=8,
                                       mode="halving"),
    "chimera-split-D2N4-doubling-W2": dict(schedule="chimera", split_backward=True, stages=2, micro_batches=4,
                                           mode="doubling", data_parallel=2),
    "bitpipe-D2N2-gpt2-W2": dict(schedule="bitpipe", stages=2, micro_batches=2, model="gpt2-tiny", data_parallel=2),
    "bitpipe-D4N8-recompute": dict(schedule="bitpipe", stages=4, micro_batches=8, recompute=True,
                                   model_overrides={"num_hidden_layers": 6}),
    "chimera4-D4N4-gpt2-W2": dict(schedule="chimera4", stages=4, micro_batches=4, model="gpt2-tiny", data_parallel=2),
    "chimera4-D4N8-recompute": dict(schedule="chimera4", stages=4, micro_batches=8, recompute=True, **SGD),
}


@pytest.mark.parametrize("flags", CASES.values(), ids=CASES.keys())
def test_split_backward_parity(flags):
    assert_parity(BASE.with_flags(steps=2, **flags))

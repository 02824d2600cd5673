"""A decomposed transformers model trains like sequential training (every parameter within 1e-5) under Chimera,
1F1B and a split-backward (zero-bubble) schedule: tied weights found by decompose stay one parameter."""

import pytest

from chimera.api import build_job as chain_job
from chimera.models.decompose import decompose
from chimera.runtime import run_local, stage_params_by_layer, train_sequential
from tests.hf_models import SEQ, batch, tiny

GPT2_TIE = [((0, "wte.weight"), (3, "lm_head.weight"))]
BERT_TIE = [((0, "embeddings.word_embeddings.weight"), (3, "cls.predictions.decoder.weight"))]
#: name -> (architecture, flags, the tied pairs decompose must find)
CASES = {
    "gpt2-chimera-D4": ("GPT2LMHeadModel", dict(schedule="chimera", stages=4, micro_batches=4), GPT2_TIE),
    "llama-1f1b-D2": ("LlamaForCausalLM", dict(schedule="1f1b", stages=2, micro_batches=2), []),
    "bert-pretraining-split-backward-D2": ("BertForPreTraining", dict(schedule="chimera", split_backward=True,
                                                                      stages=2, micro_batches=2), BERT_TIE),
    "bert-classification-zb-h1-D2": ("BertForSequenceClassification", dict(schedule="zb-h1", stages=2,
                                                                           micro_batches=2), []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decomposed_model_trains_like_sequential(case):
    arch, flags, tie = CASES[case]
    chain = decompose(tiny(arch, **({"num_labels": 3} if "Classification" in arch else {})), seq_len=SEQ)
    job = chain_job(chain, batch(arch), partition="uniform", steps=2, optimizer="adamw", lr=1e-2, **flags)
    assert chain.tied == tie
    res = run_local(job, return_state=True)
    ref = train_sequential(job)
    for m, r in zip(res.metrics, ref.losses):
        assert abs(m["loss"] - r) <= 1e-6
    assert ref.losses[1] != ref.losses[0]  # the parameters moved
    checked, trained = set(), {}
    for state in res.states.values():
        for (_, stage), params in state.items():
            for k, v in stage_params_by_layer(params, job.stage_layers[stage]).items():
                assert (v - ref.params[k]).abs().max().item() <= 1e-5, k
                checked.add(k)
                trained[k] = v
    layers = chain.build_layers(range(chain.num_layers), seed=0)
    assert checked == {(i, n) for i, layer in enumerate(layers) for n, _ in layer.named_parameters()}  # all of them
    for first, second in tie:  # the two ends trained as one parameter, on different stages
        assert job.stage_layers[0][0] == first[0] and second[0] in job.stage_layers[-1]
        assert (ref.params[first] - ref.params[second]).abs().max().item() == 0.0
        assert (trained[first] - trained[second]).abs().max().item() == 0.0

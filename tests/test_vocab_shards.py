"""Token embedding and LM head split by vocabulary (``vocab_shards``): the same model as the unsharded chain, trained
by the pipeline as by sequential training (shards split across stages, tied pairs summed pair by pair), loaded from
and exported to the full matrices of a transformers model; bad uses refused with what to change."""

from __future__ import annotations

import pytest
import torch
from test_runtime_parity import BASE, SGD_NORM, assert_parity

import chimera
from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.export import export, original_state, rebuild
from chimera.models import ChainError, SequentialModel, build_model
from chimera.models.decompose import decompose, evaluate
from chimera.models.pretrained import load_pretrained
from chimera.runtime import train_sequential
from chimera.runtime.checkpoint import load
from tests.hf_models import SEQ, VOCAB, batch, tiny, tokens

pytestmark = pytest.mark.timeout(240)


def _named(chain, model: SequentialModel, grads: bool = False) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every weight (or gradient) under its transformers name, the vocabulary shards of a matrix joined in order."""
    parts: dict[str, list[torch.Tensor]] = {}
    for i, layer in zip(model.stage.indices, model.stage.layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            parts.setdefault(chain.hf_parameter_name(i, name), []).append(p.grad if grads else p.detach())
    return {name: torch.cat(ts) for name, ts in parts.items()}


@pytest.mark.parametrize("shards", [3, 4])
def test_sharded_chain_is_the_unsharded_model(shards):
    """Built from the same seed, the same weights (each shard holds its rows of the unsplit draw); the loss bitwise,
    every gradient within 1e-6 (the head's input gradient is a sum over shards), on tokens from every shard, the
    first and last row of each, repeated tokens and padding."""
    full, sharded = build_model("gpt2-tiny", seq_len=SEQ), build_model("gpt2-tiny", seq_len=SEQ, vocab_shards=shards)
    assert sharded.num_layers == full.num_layers - 2 + 2 * shards
    fm, sm = SequentialModel(full, 7), SequentialModel(sharded, 7)
    assert all(torch.equal(a, _named(sharded, sm)[n]) for n, a in _named(full, fm).items())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (3, SEQ), generator=g)
    ids[0, :4] = ids[1, :4]  # repeated tokens: their embedding gradients add up
    ids[2, :2 * shards] = torch.tensor([r for a, b in sharded.bounds for r in (a, b - 1)])
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    inputs, labels = {"input_ids": ids, "attention_mask": mask}, {"labels": torch.where(mask.bool(), ids, -100)}
    want, got = fm(inputs, labels), sm(inputs, labels)
    assert torch.equal(got, want)
    want.backward()
    got.backward()
    wg, gg = _named(full, fm, grads=True), _named(sharded, sm, grads=True)
    assert sorted(wg) == sorted(gg)
    assert max((wg[n] - gg[n]).abs().max().item() for n in wg) <= 1e-6
    # the gradient of the tied matrix: the embedding's use and the head's, summed (both ends of every shard pair)
    assert (wg["lm_head.weight"] - gg["transformer.wte.weight"]).abs().max().item() <= 1e-6


def test_sharded_chain_trains_like_the_unsharded_with_dropout():
    """Same seed, same run: the blocks and the embedding's dropout draw the masks of the unsplit layers they are
    (``seed_index``), so three AdamW steps give the unsplit model's losses and weights."""
    runs = {}
    for k in (1, 4):
        cfg = BASE.with_flags(model="gpt2-tiny", vocab_shards=k, steps=3, optimizer="adamw", clip_grad=0.0,
                              model_overrides={"resid_pdrop": 0.2, "embd_pdrop": 0.2, "attn_pdrop": 0.2})
        runs[k] = train_sequential(compile_job(cfg))
    assert runs[4].losses == pytest.approx(runs[1].losses, abs=1e-6)
    assert runs[4].losses[0] == runs[1].losses[0]
    chain = build_model("gpt2-tiny", vocab_shards=4)
    got = {}
    for i, p in runs[4].params.items():
        got.setdefault(chain.hf_parameter_name(*i) if isinstance(i, tuple) else i, []).append(p)
    full = build_model("gpt2-tiny")
    want = {full.hf_parameter_name(*i) if isinstance(i, tuple) else i: p for i, p in runs[1].params.items()}
    assert max((torch.cat(got[n]) - w).abs().max().item() for n, w in want.items()) <= 1e-5


@pytest.mark.parametrize("schedule,stages,layers", [("1f1b", 3, "2,6,2"), ("chimera", 2, "2,8")])
def test_pipeline_split_inside_the_shards_trains_like_sequential(schedule, stages, layers):
    """Stage boundaries inside the embedding shards and the head shards. 1F1B: shard pair 0 tied between stages 0
    and 1, pair 1 between 0 and 2, pair 2 between 1 and 2 (three sets of ranks); Chimera: pair 2 on one stage (one
    parameter there), pairs 0-1 across, each stage in two replicas. Every pair's gradient is summed on its own."""
    cfg = BASE.with_flags(model="gpt2-tiny", vocab_shards=3, schedule=schedule, stages=stages, micro_batches=2,
                          steps=2, partition=layers, **SGD_NORM)
    assert_parity(cfg)


def test_pretrained_shards_hold_the_rows_and_export_the_full_matrices(tmp_path):
    """A saved GPT-2 (tied, and with its own head) loads split by vocabulary and computes its logits; the chain's
    weights, changed, export to the whole matrices the transformers model takes (tied once, untied twice)."""
    inputs = tokens(5, 0, 0, batch=3)
    for tie in (True, False):
        source = tiny("GPT2LMHeadModel", tie_word_embeddings=tie).eval()
        source.save_pretrained(tmp_path / str(tie))
        chain = load_pretrained(tmp_path / str(tie), seq_len=SEQ, vocab_shards=3, train=False)
        assert len(chain.tied) == (3 if tie else 0) and chain.num_layers == 2 + 6
        with torch.no_grad():
            assert (evaluate(chain, inputs) - source(**inputs).logits).abs().max().item() <= 1e-5
        layers = chain.build_layers(range(chain.num_layers), seed=0)
        with torch.no_grad():
            for p in {id(p): p for layer in layers for p in layer.parameters()}.values():
                p.add_(torch.randn_like(p) * 0.1)  # trained: a tied shard pair stays one tensor
        state = {f"layer{i}.{n}": p.detach().clone() for i, layer in enumerate(layers)
                 for n, p in layer.named_parameters(remove_duplicate=False)}
        params = original_state(state, chain.source)
        assert sorted(params) == sorted(source.state_dict())
        assert torch.equal(params["transformer.wte.weight"],
                           torch.cat([state[f"layer{j}.wte.weight"] for j in range(3)]))
        assert torch.equal(params["lm_head.weight"], torch.cat([state[f"layer{5 + j}.lm_head.weight"]
                                                                for j in range(3)]))
        model = rebuild(chain.source, params)
        assert (model.lm_head.weight is model.transformer.wte.weight) == tie
        with torch.no_grad():
            assert (model(**inputs).logits - evaluate(chain, inputs, state=state)).abs().max().item() <= 1e-5


def test_pretrained_shards_train_on_the_pipeline_and_reload_in_transformers(tmp_path):
    import transformers

    tiny("GPT2LMHeadModel").save_pretrained(tmp_path / "src")
    chain = load_pretrained(tmp_path / "src", seq_len=SEQ, vocab_shards=2)
    chimera.train(chain, batch("GPT2LMHeadModel"), schedule="1f1b", stages=2, micro_batches=2, steps=1,
                  optimizer="adamw", lr=1e-2, partition="uniform", checkpoint_dir=str(tmp_path / "ckpt"))
    export(tmp_path / "ckpt", hf_dir=tmp_path / "out")
    inputs = tokens(5, 0, 0, batch=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    trained = load(tmp_path / "ckpt")
    assert torch.equal(model.transformer.wte.weight.detach()[VOCAB // 2:], trained["layer1.wte.weight"])
    with torch.no_grad():
        assert (model(**inputs).logits - evaluate(chain, inputs, state=trained)).abs().max().item() <= 1e-5


def test_bad_uses_are_refused_naming_what_to_change():
    with pytest.raises(ValueError, match=r"only the GPT-2 presets split .* bert-tiny is a bert preset"):
        build_model("bert-tiny", vocab_shards=2)
    with pytest.raises(ValueError, match=r"vocab_shards must be in \[1, 8192\]"):
        build_model("gpt2-tiny", vocab_shards=9000)
    with pytest.raises(ConfigError, match="--vocab-shards 2 splits a GPT-2 preset"):
        compile_job(TrainConfig.from_flags(chain="tests.delay_chain:delay_20ms", vocab_shards=2, stages=2))
    with pytest.raises(ConfigError, match="only the GPT-2 presets"):
        compile_job(TrainConfig.from_flags(model="bert-tiny", vocab_shards=2, stages=2))
    with pytest.raises(ChainError, match="LlamaForCausalLM cannot be split by vocabulary"):
        decompose(tiny("LlamaForCausalLM"), seq_len=SEQ, vocab_shards=2)
    with pytest.raises(ChainError, match="vocab_shards=2 splits the embedding and head of a transformers model"):
        decompose([torch.nn.Linear(2, 2)], example=(torch.zeros(1, 2), torch.zeros(1, 2)),
                  loss=torch.nn.functional.mse_loss, vocab_shards=2)
    chain = build_model("gpt2-tiny", seq_len=SEQ, vocab_shards=2)
    with pytest.raises(ValueError, match="does not take them; drop them from the inputs"):
        chain.build_layers([0], 0)[0](torch.zeros(1, SEQ, dtype=torch.long), token_type_ids=torch.zeros(1, SEQ))

"""Transformer presets as layer chains: stage/sequential parity, tied weights, transformers parity, inferred
boundaries, partition."""

from __future__ import annotations

import pytest
import torch
from transformers import BertForPreTraining, GPT2LMHeadModel

from chimera.models import SequentialModel, StageModule, TensorSpec, build_model, build_stage
from chimera.plan.partition import partition

B, S, SEED = 2, 16, 7


def _batch(model, step: int = 0, pad: int = 0):
    inputs, labels = model.dataset(B, SEED).get(step, 0, 0)
    if pad:  # right-pad the second sample
        inputs["attention_mask"][1, -pad:] = 0
        labels["labels"][1, -pad:] = -100
    return inputs, labels


def _run_pipeline(stages: list[StageModule], inputs, labels) -> torch.Tensor:
    """Forward/backward through separately built stages, passing detached activations like a runtime."""
    outs, ins = [], []
    acts = None
    for stage in stages:
        if acts is not None:
            acts = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in acts)
        ins.append(acts)
        out = stage(acts, inputs=inputs, labels=labels)
        outs.append(out)
        acts = out
    loss = outs[-1]
    loss.backward()
    for k in range(len(stages) - 2, -1, -1):
        pairs = [(o, i.grad) for o, i in zip(outs[k], ins[k + 1]) if i.grad is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return loss


def _grads_by_layer(stages: list[StageModule]) -> dict[tuple[int, str], torch.Tensor]:
    out = {}
    for stage in stages:
        for idx, layer in zip(stage.indices, stage.layers):
            for name, p in layer.named_parameters(remove_duplicate=False):
                out[(idx, name)] = p.grad
    return out


CASES = [
    ("bert-tiny", 2, 2),
    ("bert-tiny", 4, 4),
    ("gpt2-tiny", 4, 2),
    ("gpt2-tiny", 4, 4),
    ("gpt2-tiny", 2, 3),
]


@pytest.mark.parametrize(("name", "blocks", "stages"), CASES)
def test_stages_match_sequential_bitwise(name: str, blocks: int, stages: int) -> None:
    model = build_model(name, num_hidden_layers=blocks, seq_len=S)
    inputs, labels = _batch(model, pad=3)
    seq = SequentialModel(model, seed=SEED)
    ref_loss = seq(inputs, labels)
    ref_loss.backward()
    ref = _grads_by_layer([seq.stage])

    parts = partition(model, stages)
    pipe = [build_stage(model, idx, seed=SEED) for idx in parts]
    loss = _run_pipeline(pipe, inputs, labels)
    assert torch.equal(loss.detach(), ref_loss.detach())

    got = _grads_by_layer(pipe)
    assert got.keys() == ref.keys()
    ((emb, dec),) = model.tied_parameters()
    for key, grad in got.items():
        if key in (emb, dec):
            continue
        assert torch.equal(grad, ref[key]), key
    # the sequential model shares the tied Parameter, so its grad is the sum of both uses
    assert ref[emb] is ref[dec]
    assert torch.equal(got[emb] + got[dec], ref[emb])


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny"])
def test_tied_weights(name: str) -> None:
    model = build_model(name)
    last = model.num_layers - 1
    (((li, pi), (lj, pj)),) = model.tied_parameters()
    assert (li, lj) == (0, last)
    first_alone = model.build_layers([0], seed=SEED)[0]
    last_alone = model.build_layers([last], seed=SEED)[0]
    assert torch.equal(first_alone.get_parameter(pi), last_alone.get_parameter(pj))
    both = model.build_layers([0, last], seed=SEED)
    assert both[0].get_parameter(pi) is both[1].get_parameter(pj)
    moved = model.build_layers([0, last], seed=SEED, device="meta")
    assert moved[0].get_parameter(pi) is moved[1].get_parameter(pj)
    assert moved[0].get_parameter(pi).device.type == "meta"
    other_seed = model.build_layers([last], seed=SEED + 1)[0]
    assert not torch.equal(other_seed.get_parameter(pj), last_alone.get_parameter(pj))


def test_layer_depends_only_on_seed_and_index() -> None:
    model = build_model("bert-tiny", num_hidden_layers=3)
    a = model.build_layers([0, 1], seed=SEED)[1]
    b = model.build_layers([1, 2], seed=SEED)[0]
    c = model.build_layers([2, 1], seed=SEED)[1]
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), n
    blk2 = model.build_layers([2], seed=SEED)[0]
    assert not torch.equal(a.layer.attention.self.query.weight, blk2.layer.attention.self.query.weight)


def _load_hf(model, hf_cls):
    seq = SequentialModel(model, seed=SEED)
    hf = hf_cls(model.config).eval()
    sd = model.hf_state_dict(dict(zip(seq.stage.indices, seq.stage.layers)))
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return seq, hf


@pytest.mark.parametrize("pad", [0, 4])
def test_bert_matches_transformers(pad: int) -> None:
    model = build_model("bert-tiny", num_hidden_layers=3, seq_len=S)
    inputs, labels = _batch(model, pad=pad)
    seq, hf = _load_hf(model, BertForPreTraining)
    assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight
    with torch.no_grad():
        ours = seq(inputs, labels)
        theirs = hf(**inputs, labels=labels["labels"], next_sentence_label=labels["next_sentence_label"]).loss
    assert abs(ours.item() - theirs.item()) < 1e-5


@pytest.mark.parametrize("pad", [0, 4])
def test_gpt2_matches_transformers(pad: int) -> None:
    model = build_model("gpt2-tiny", seq_len=S)
    inputs, labels = _batch(model, pad=pad)
    seq, hf = _load_hf(model, GPT2LMHeadModel)
    with torch.no_grad():
        ours = seq(inputs, labels)
        theirs = hf(**inputs, labels=labels["labels"]).loss
    assert abs(ours.item() - theirs.item()) < 1e-5


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny", "delay"])
def test_boundaries_inferred_on_meta_match_real_outputs(name: str) -> None:
    model = build_model(name, seq_len=S)
    inputs, labels = _batch(model)
    layers = model.build_layers(range(model.num_layers), seed=SEED)
    specs = model.boundaries(B)
    assert specs[0] == [] and len(specs) == model.num_layers
    acts = layers[0](**inputs)
    for boundary in range(1, model.num_layers):
        acts = acts if isinstance(acts, tuple) else (acts,)
        got = [TensorSpec(tuple(a.shape), a.dtype, a.requires_grad) for a in acts]
        assert got == specs[boundary], boundary
        if boundary < model.num_layers - 1:
            acts = layers[boundary](*acts)
    assert model.boundaries(2 * B)[1][0].shape[0] == 2 * B  # any micro-batch size, from the one example


def test_single_stage_and_stage_errors() -> None:
    model = build_model("gpt2-tiny", seq_len=S)
    inputs, labels = _batch(model)
    (only,) = partition(model, 1)
    stage = build_stage(model, only, seed=SEED)
    assert stage.is_first and stage.is_last
    assert torch.equal(stage(None, inputs, labels), SequentialModel(model, seed=SEED)(inputs, labels))
    with pytest.raises(ValueError, match="labels"):
        stage(None, inputs)
    middle = build_stage(model, [2, 3], seed=SEED)
    with pytest.raises(ValueError, match="activations"):
        middle(None)
    with pytest.raises(ValueError, match="consecutive"):
        StageModule(model.build_layers([1, 3], seed=SEED), [1, 3], model.num_layers)


def test_build_model_presets_and_errors() -> None:
    with pytest.raises(ValueError, match="bert-tiny.*gpt2-tiny"):
        build_model("bert-huge")
    with pytest.raises(ValueError, match="no field"):
        build_model("bert-tiny", not_a_field=3)
    with pytest.raises(ValueError, match="seq_len"):
        build_model("gpt2-tiny", seq_len=100_000)
    assert build_model("bert-tiny", num_hidden_layers=4).num_layers == 6
    assert build_model("gpt2-tiny", num_hidden_layers=6).num_layers == 8
    # big presets are only configs: count parameters on the meta device
    assert 110e6 < sum(build_model("bert-base").layer_num_params()) < 140e6
    g = build_model("gpt2-1.3b")
    assert g.num_layers == 66 and g.config.n_embd == 1280 and g.config.n_head == 20
    assert build_model("bert-48").num_blocks == 48
    for name in ("bert-tiny", "gpt2-tiny"):
        cfg = build_model(name).config
        assert cfg._attn_implementation == "eager"


def test_partition_methods() -> None:
    model = build_model("bert-tiny", num_hidden_layers=12)  # 14 layers
    for method in ("uniform", "params"):
        for d in range(1, model.num_layers + 1):
            parts = partition(model, d, method)
            assert len(parts) == d and all(parts)
            assert [i for p in parts for i in p] == list(range(model.num_layers))
    assert [len(p) for p in partition(model, 4)] == [4, 3, 3, 4]  # 3 blocks each + embeddings / head
    assert [len(p) for p in partition(model, 5)] == [3, 3, 3, 2, 3]  # 2 extra blocks go to middle stages
    five = build_model("bert-tiny", num_hidden_layers=5)
    assert [len(p) for p in partition(five, 3)] == [3, 2, 2]  # then to stage 0, the head's stage last
    tiny = build_model("bert-tiny")
    assert partition(tiny, 3) == [[0, 1], [2], [3]]  # the head keeps a stage of its own
    counts = model.layer_num_params()
    per_stage = [sum(counts[i] for i in p) for p in partition(model, 4, "params")]
    uni = [sum(counts[i] for i in p) for p in partition(model, 4, "uniform")]
    assert max(per_stage) <= max(uni)
    assert (
        partition(model, 3, [4, 5, 5]) == partition(model, 3, [0, 4, 9, 14]) == partition(model, 3, "4,5,5")
    )
    assert partition(model, 3, "4,5,5")[1] == [4, 5, 6, 7, 8]


def test_partition_errors() -> None:
    tiny = build_model("bert-tiny")
    with pytest.raises(ValueError, match=r"D=8 is larger than the 4 layers of bert-tiny; use --stages <= 4"):
        partition(tiny, 8)
    with pytest.raises(ValueError, match=">= 1"):
        partition(tiny, 0)
    with pytest.raises(ValueError, match="sum to the 4 layers"):
        partition(tiny, 2, [1, 2])
    with pytest.raises(ValueError, match="from 0 to 4"):
        partition(tiny, 2, [0, 3, 3])
    with pytest.raises(ValueError, match="entries for D=2"):
        partition(tiny, 2, [4])
    with pytest.raises(ValueError, match="unknown partition method"):
        partition(tiny, 2, "balanced")


def test_delay_sleeps_scale_with_the_batch_rows(monkeypatch):
    """With ``rows`` a delay block's forward, input-gradient and weight-gradient sleeps scale with its batch's rows
    (half a micro-batch, as backward halving runs, sleeps half); without it every batch sleeps the full time."""
    import chimera.models.delay as delay

    slept: list[float] = []
    monkeypatch.setattr(delay.time, "sleep", slept.append)
    for rows, batch, want in ((4, 2, [0.05, 0.1, 0.15]), (4, 4, [0.1, 0.2, 0.3]), (None, 2, [0.1, 0.2, 0.3])):
        block = delay._Block(16, 0.1, 0.2, 0.3, rows)
        slept.clear()
        block(torch.ones(batch, 16, requires_grad=True)).sum().backward()
        assert sorted(slept) == pytest.approx(want), (rows, batch)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="timer slack is Linux's")
def test_delay_sleeps_with_a_1ns_timer_slack_in_the_thread_that_runs_it():
    """The delay model's sleeps last what they say: the thread that runs its forward and backward gets a 1 ns timer
    slack (the default 50 µs makes every sleep ~0.08 ms long on the development machine); other threads keep theirs."""
    import threading

    import chimera.models.delay as delay

    seen: dict[str, int | None] = {}

    def run(name: str, sleeps: bool) -> None:
        import ctypes

        ctypes.CDLL(None).prctl(29, 50_000, 0, 0, 0)  # the default (a new thread inherits its creator's)
        seen[name + " before"] = delay.timer_slack_ns()
        s = 0.001 if sleeps else 0.0
        block = delay._Block(16, s, s, s, None)
        block(torch.ones(2, 16, requires_grad=True)).sum().backward()
        seen[name] = delay.timer_slack_ns()

    for name, sleeps in (("sleeping", True), ("never sleeping", False)):
        t = threading.Thread(target=run, args=(name, sleeps))
        t.start()
        t.join()
    assert seen["sleeping before"] == 50_000 and seen["sleeping"] == 1
    assert seen["never sleeping"] == 50_000

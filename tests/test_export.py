"""Pretrained in, trained out: a save_pretrained directory loads as a chain computing the model's logits; a trained
checkpoint exports as a transformers directory and a torch state_dict that compute the pipeline's logits."""

import json

import pytest
import torch
from torch import nn

import chimera
from chimera.export import ExportError, export, original_state
from chimera.models.decompose import decompose, evaluate
from chimera.models.pretrained import PretrainedError, load_pretrained
from chimera.runtime.checkpoint import load
from tests.hf_models import SEQ, batch, tiny, tokens

#: architecture -> (Auto class that reloads it, config overrides)
CASES = {
    "GPT2LMHeadModel": ("AutoModelForCausalLM", {}),
    "LlamaForCausalLM": ("AutoModelForCausalLM", {}),
    "BertForSequenceClassification": ("AutoModelForSequenceClassification", {"num_labels": 3}),
}


def _logits(out):
    return out.logits


@pytest.mark.parametrize("arch", sorted(CASES))
def test_pretrained_in_trained_out(arch, tmp_path):
    import transformers

    auto, overrides = CASES[arch]
    source = tiny(arch, **overrides)
    source.save_pretrained(tmp_path / "src")
    inputs = tokens(5, 0, 0, batch=3)

    chain = load_pretrained(tmp_path / "src", seq_len=SEQ)
    with torch.no_grad():  # pretrained in: the chain computes the saved model's logits
        want = source.eval()(**inputs).logits
    assert (evaluate(chain, inputs) - want).abs().max().item() <= 1e-5

    chimera.train(chain, batch(arch), schedule="chimera", stages=2, micro_batches=2, steps=2, optimizer="adamw",
                  lr=1e-2, partition="uniform", checkpoint_dir=str(tmp_path / "ckpt"))
    written = export(tmp_path / "ckpt", hf_dir=tmp_path / "out", torch_file=tmp_path / "out.pt")
    assert written == {"hf": str(tmp_path / "out"), "torch": str(tmp_path / "out.pt")}

    trained = load(tmp_path / "ckpt")
    pipeline = evaluate(chain, inputs, state=trained)  # the checkpoint's weights, through the chain's layers
    assert (pipeline - want).abs().max().item() > 1e-3  # training moved them
    reloaded = getattr(transformers, auto).from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert type(reloaded).__name__ == arch
    with torch.no_grad():
        assert (reloaded(**inputs).logits - pipeline).abs().max().item() <= 1e-5

    state = torch.load(tmp_path / "out.pt")
    assert sorted(state) == sorted(source.state_dict())  # the model's own names, tied ones included
    fresh = tiny(arch, **overrides).eval()
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert (fresh(**inputs).logits - pipeline).abs().max().item() <= 1e-5


def test_tied_weight_is_written_once_and_reloads_tied(tmp_path):
    import transformers
    from safetensors import safe_open

    tiny("GPT2LMHeadModel").save_pretrained(tmp_path / "src")
    chain = load_pretrained(tmp_path / "src", seq_len=SEQ)
    chimera.train(chain, batch("GPT2LMHeadModel"), schedule="1f1b", stages=2, micro_batches=2, steps=1,
                  optimizer="adamw", lr=1e-2, partition="uniform", checkpoint_dir=str(tmp_path / "ckpt"))
    manifest = json.loads(next((tmp_path / "ckpt").glob("step-*/manifest.json")).read_text())
    assert manifest["source"]["architecture"] == "GPT2LMHeadModel"  # export needs nothing but the checkpoint
    export(tmp_path / "ckpt", hf_dir=tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight.detach(), load(tmp_path / "ckpt")["layer0.wte.weight"])


def test_torch_export_of_a_decomposed_cnn_uses_the_models_names(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
                          nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 3)))

    def images(step, mb, rank):
        g = torch.Generator().manual_seed(step * 10 + mb)
        return torch.randn(2, 3, 4, 4, generator=g), torch.randint(0, 3, (2,), generator=g)

    chain = decompose(model, example=images(0, 0, 0), loss=nn.functional.cross_entropy, name="cnn")
    chimera.train(chain, images, schedule="gpipe", stages=2, micro_batches=2, steps=1, optimizer="sgd", lr=0.1,
                  partition="uniform", checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(ExportError, match="not a transformers model: export it with torch_file="):
        export(tmp_path / "ckpt", hf_dir=tmp_path / "out")
    with pytest.raises(ExportError, match="pass chain="):
        export(tmp_path / "ckpt", torch_file=tmp_path / "cnn.pt")
    export(tmp_path / "ckpt", torch_file=tmp_path / "cnn.pt", chain=chain)
    state = torch.load(tmp_path / "cnn.pt")
    assert sorted(state) == sorted(model.state_dict())
    assert torch.equal(state["1.1.weight"], load(tmp_path / "ckpt")["layer1.1.weight"])
    assert not torch.equal(state["1.1.weight"], model[1][1].weight.detach())  # trained, not the original


def test_tied_ends_that_differ_are_refused():
    chain = decompose(tiny("GPT2LMHeadModel"), seq_len=SEQ)
    state = {f"layer{i}.{n}": p.detach().clone() for i, layer in enumerate(chain.build_layers(range(4), 0))
             for n, p in layer.named_parameters()}
    assert torch.equal(original_state(state, chain.source)["lm_head.weight"], state["layer0.wte.weight"])
    state["layer3.lm_head.weight"] += 1.0
    with pytest.raises(ExportError, match=r"layer0.wte.weight and layer3.lm_head.weight are one parameter of the "
                                          r"model \(transformer.wte.weight\) but differ by 1"):
        original_state(state, chain.source)


def test_checkpoint_of_a_plain_chain_is_refused(tmp_path):
    chain = chimera.LayerChain([lambda: nn.Linear(4, 4), lambda: nn.Linear(4, 2)], nn.functional.cross_entropy,
                               (torch.randn(2, 4), torch.zeros(2, dtype=torch.long)), name="plain")
    chimera.train(chain, lambda s, m, r: (torch.randn(2, 4), torch.zeros(2, dtype=torch.long)), schedule="gpipe",
                  stages=2, micro_batches=2, steps=1, partition="uniform", checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(ExportError, match="without a source record"):
        export(tmp_path / "ckpt", torch_file=tmp_path / "x.pt")
    with pytest.raises(ExportError, match="nothing to write"):
        export(tmp_path / "ckpt")
    with pytest.raises(ExportError, match="no complete checkpoint"):
        export(tmp_path, hf_dir=tmp_path / "out")


def test_bad_pretrained_directories_are_refused(tmp_path):
    with pytest.raises(PretrainedError, match="no such directory"):
        load_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PretrainedError, match="no config.json"):
        load_pretrained(tmp_path / "empty")
    config = tiny("GPT2LMHeadModel").config
    config.save_pretrained(tmp_path / "no-architectures")
    with pytest.raises(PretrainedError, match=r"names no architectures; set \"architectures\""):
        load_pretrained(tmp_path / "no-architectures")
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path / "config-only")
    with pytest.raises(PretrainedError, match=r"config-only: no weights \(model.safetensors or"):
        load_pretrained(tmp_path / "config-only")
    import transformers

    transformers.GPT2ForSequenceClassification(tiny("GPT2LMHeadModel").config).save_pretrained(tmp_path / "cls")
    with pytest.raises(PretrainedError, match="architecture GPT2ForSequenceClassification is not one chimera can "
                                              "split; supported: BertForPreTraining"):
        load_pretrained(tmp_path / "cls")

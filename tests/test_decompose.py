"""decompose(): a transformers model's chain computes the model's logits and loss; tied weights are found; lists of
modules (CNNs) become chains; models that cannot be split are refused with the module and the reason."""

import cloudpickle
import pytest
import torch
from torch import nn

from chimera.models import ChainError
from chimera.models.decompose import decompose, evaluate
from tests.hf_models import SEQ, labels_for, tiny, tokens

ARCHS = {
    "gpt2": ("GPT2LMHeadModel", {}),
    "gpt2-eager": ("GPT2LMHeadModel", {"attn_implementation": "eager"}),
    "llama": ("LlamaForCausalLM", {}),
    "llama-tied-eager": ("LlamaForCausalLM", {"tie_word_embeddings": True, "attn_implementation": "eager"}),
    "bert-pretraining": ("BertForPreTraining", {}),
    "bert-classification": ("BertForSequenceClassification", {"num_labels": 3}),
    "bert-regression": ("BertForSequenceClassification", {"num_labels": 1}),
    "bert-multilabel": ("BertForSequenceClassification", {"num_labels": 3,
                                                          "problem_type": "multi_label_classification"}),
}


def _inputs(arch: str) -> dict[str, torch.Tensor]:
    inputs = tokens(0, 1, 0, batch=3)  # sample 0 padded
    if arch.startswith("Bert"):
        inputs["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(3, -1)
    return inputs


def _labels(arch: str, overrides: dict, inputs: dict) -> dict[str, torch.Tensor]:
    labels = labels_for(arch, inputs)
    if overrides.get("num_labels") == 1:
        return {"labels": torch.randn(3)}
    if overrides.get("problem_type") == "multi_label_classification":
        return {"labels": (torch.rand(3, 3) > 0.5).float()}
    return labels


@pytest.mark.parametrize("case", sorted(ARCHS))
def test_chain_computes_the_models_logits_and_loss(case):
    arch, overrides = ARCHS[case]
    model = tiny(arch, **overrides).eval()
    chain = decompose(model, seq_len=SEQ)
    inputs = _inputs(arch)
    labels = _labels(arch, overrides, inputs)
    with torch.no_grad():
        out = model(**inputs, **labels)
    got = evaluate(chain, inputs)
    if arch == "BertForPreTraining":
        want = (out.prediction_logits, out.seq_relationship_logits)
        assert all((a - b).abs().max().item() <= 1e-5 for a, b in zip(got, want))
    else:
        assert got.shape == out.logits.shape and (got - out.logits).abs().max().item() <= 1e-5
    chain_labels = labels["labels"] if arch == "BertForSequenceClassification" else labels
    assert abs(chain.loss(got, chain_labels).item() - out.loss.item()) <= 1e-5
    assert chain.num_layers == 4 and chain.name == arch and chain.source["architecture"] == arch


def test_tied_weights_are_found_from_the_models_own_tensors():
    assert decompose(tiny("GPT2LMHeadModel"), seq_len=SEQ).tied == [((0, "wte.weight"), (3, "lm_head.weight"))]
    assert decompose(tiny("LlamaForCausalLM"), seq_len=SEQ).tied == []  # Llama's head is its own
    tied = decompose(tiny("LlamaForCausalLM", tie_word_embeddings=True), seq_len=SEQ).tied
    assert tied == [((0, "embed_tokens.weight"), (3, "lm_head.weight"))]
    bert = decompose(tiny("BertForPreTraining"), seq_len=SEQ)
    assert bert.tied == [((0, "embeddings.word_embeddings.weight"), (3, "cls.predictions.decoder.weight"))]
    # the decoder bias is the prediction bias inside the head layer: one parameter there, nothing to declare
    head = bert.build_layers([3], seed=0)[0]
    assert head.cls.predictions.decoder.bias is head.cls.predictions.bias
    names = bert.source["names"]
    assert names[3]["cls.predictions.decoder.weight"] == "bert.embeddings.word_embeddings.weight"
    assert names[1]["layer.attention.self.query.weight"] == "bert.encoder.layer.0.attention.self.query.weight"
    assert bert.source["aliases"]["bert.embeddings.word_embeddings.weight"] == ["cls.predictions.decoder.weight"]


def test_layers_travel_with_cloudpickle_and_leave_the_model_alone():
    model = tiny("LlamaForCausalLM").eval()
    chain = cloudpickle.loads(cloudpickle.dumps(decompose(model, seq_len=SEQ)))
    inputs = _inputs("LlamaForCausalLM")
    with torch.no_grad():
        want = model(**inputs).logits
    assert (evaluate(chain, inputs) - want).abs().max().item() <= 1e-5
    specs = chain.boundaries(2)  # hidden, padding mask and position ids travel between blocks
    assert [s.shape for s in specs[1]] == [(2, SEQ, 32), (2, SEQ), (2, SEQ)]
    assert [s.dtype for s in specs[1]] == [torch.float32, torch.int64, torch.int64]


def vgg() -> list[nn.Module]:
    """A VGG-like chain: conv blocks, the last one pooling + flatten + linear."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))]


class Residual(nn.Module):
    """A ResNet basic block: its own forward (with a skip connection) stays inside one layer."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.conv(x))


class ResNetish(nn.Module):
    """Children stem, block, head; forward is their chain."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = Residual(8)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


class SkipOverChildren(ResNetish):
    """Same children, but forward adds the stem's output again: not a chain of its children."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        return self.head(self.block(s) + s)


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3])


@pytest.mark.parametrize("make", [vgg, lambda: nn.Sequential(*vgg()), ResNetish], ids=["list", "sequential", "module"])
def test_cnn_from_its_blocks(make):
    model = make()
    x, y = _images()
    chain = decompose(model, example=(x, y), loss=nn.functional.cross_entropy)
    want = nn.Sequential(*model)(x) if isinstance(model, list) else model(x)
    assert torch.equal(evaluate(chain, x), want.detach())
    if isinstance(model, ResNetish):
        assert chain.source["names"][1]["conv.weight"] == "block.conv.weight"
    else:  # layer 0 is the first block: its conv is "0" inside it, "0.0" in the model
        assert chain.source["names"][0]["0.weight"] == "0.0.weight"
    assert chain.source["kind"] == "torch" and chain.tied == []


def test_tied_modules_in_a_list_are_declared():
    emb = nn.Embedding(20, 8)
    head = nn.Linear(8, 20, bias=False)
    head.weight = emb.weight
    ids = torch.randint(0, 20, (2, 5))
    chain = decompose([emb, nn.Linear(8, 8), head], example=(ids, ids),
                      loss=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    assert chain.tied == [((0, "weight"), (2, "weight"))]
    assert chain.source["aliases"] == {"0.weight": ["2.weight"]}


def _vectors() -> dict:
    return {"example": (torch.randn(2, 4), torch.zeros(2, 2)), "loss": nn.functional.mse_loss}


@pytest.mark.parametrize("model,kwargs,message", [
    (lambda: "a model", {}, "needs an nn.Module, an nn.Sequential or a list of modules, got str"),
    (lambda: _gpt2_classifier(), {}, r"GPT2ForSequenceClassification \(module path '', the model itself\) is not a "
                                     r"transformers architecture chimera can split; supported: BertForPreTraining, "
                                     r"BertForSequenceClassification, GPT2LMHeadModel, LlamaForCausalLM"),
    (lambda: tiny("GPT2LMHeadModel", add_cross_attention=True), {},
     r"GPT2LMHeadModel cannot be split at module 'transformer.h.0.crossattention'"),
    (lambda: tiny("GPT2LMHeadModel"), {"seq_len": 64}, r"seq_len=64 does not fit GPT2LMHeadModel"),
    (SkipOverChildren, {"example": _images(), "loss": nn.functional.cross_entropy},
     r"the forward of SkipOverChildren \(module path '', the model itself\) is not a chain of its children"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 2)])), _vectors(),
     r"module '1' of Sequential is a ModuleList"),
    (lambda: [nn.Linear(4, 4), "relu"], _vectors(), "item 1 of the list is a str"),
    (lambda: nn.Sequential(nn.Linear(4, 2)), {}, r"decompose\(Sequential\) needs loss= and example="),
    (lambda: nn.Sequential(nn.Linear(4, 3), nn.Linear(5, 2)), _vectors(), r"layer 1 of chain \(Linear\) fails"),
])
def test_models_that_cannot_be_split_are_refused(model, kwargs, message):
    with pytest.raises(ChainError, match=message):
        decompose(model(), **kwargs)


def _gpt2_classifier() -> nn.Module:
    import transformers

    return transformers.GPT2ForSequenceClassification(tiny("GPT2LMHeadModel").config)


def test_example_defaults_to_a_micro_batch_of_the_data():
    from chimera.data.base import FunctionDataset

    def data(micro_batch_size: int, seed: int, microbatches: int, data_parallel: int) -> FunctionDataset:
        ids = torch.randint(0, 64, (micro_batch_size, 8), generator=torch.Generator().manual_seed(seed))
        return FunctionDataset(lambda s, m, r: ({"input_ids": ids}, {"labels": ids}))

    chain = decompose(tiny("GPT2LMHeadModel"), data=data, micro_batch_size=3)
    assert chain.example[0]["input_ids"].shape == (3, 8) and chain.data is data  # not the default seq_len
    x, y = _images()
    cnn = decompose(vgg(), loss=nn.functional.cross_entropy, data=lambda b, s, n, w: FunctionDataset(lambda *a: (x, y)))
    assert torch.equal(cnn.example[0], x)

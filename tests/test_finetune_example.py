"""The fine-tuning path end to end: examples/finetune_gpt2.py fine-tunes a saved GPT-2 on a text file, the checkpoint
exports and reloads with AutoModelForCausalLM; the fine-tuning datasets' labels give transformers' own losses."""

from pathlib import Path

import torch

from chimera.data.finetune import sentence_pair_data
from chimera.export import export
from chimera.models.decompose import decompose, evaluate
from chimera.runtime.checkpoint import load
from examples.finetune_gpt2 import factory, main
from tests.test_finetune_data import BERT_TOK, WIKI, _tsv

ROOT = Path(__file__).resolve().parents[1]


def _tiny_gpt2(path) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=8192, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


def test_example_fine_tunes_exports_and_reloads(tmp_path):
    import transformers

    _tiny_gpt2(tmp_path / "gpt2")
    (tmp_path / "wiki.txt").write_text(WIKI * 4)
    chain, data = factory(str(tmp_path / "gpt2"), str(tmp_path / "wiki.txt"), seq_len=16, micro_batch_size=2,
                          micro_batches=2)
    inputs, labels = data.get(0, 1, 0)
    assert torch.equal(chain.dataset(2, 0, 2, 1).get(0, 1, 0)[0]["input_ids"], inputs["input_ids"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    with torch.no_grad():  # the shifted labels are transformers' shift_labels: the same loss
        want = model(**inputs, labels=inputs["input_ids"], shift_labels=labels["shift_labels"]).loss
    assert abs(chain.loss(evaluate(chain, inputs), labels).item() - want.item()) <= 1e-5

    records = main([str(tmp_path / "gpt2"), str(tmp_path / "wiki.txt"), "--seq-len", "16", "--micro-batch-size", "2",
                    "--micro-batches", "2", "--steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert [r["step"] for r in records] == [0, 1]
    export(tmp_path / "ckpt", hf_dir=tmp_path / "tuned")
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned", local_files_only=True).eval()
    with torch.no_grad():
        diff = (tuned(**inputs).logits - evaluate(chain, inputs, state=load(tmp_path / "ckpt"))).abs().max().item()
    assert diff <= 1e-5
    assert (tmp_path / "tuned" / "config.json").is_file()


def test_sentence_pairs_give_the_classifiers_own_loss(tmp_path):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=8192, max_position_embeddings=64, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg).eval()
    data = sentence_pair_data(_tsv(tmp_path), BERT_TOK, seq_len=24, num_labels=2, vocab_size=cfg.vocab_size)
    inputs, labels = data(3, 0, 2).get(0, 1, 0)
    chain = decompose(model, seq_len=24)
    with torch.no_grad():
        out = model(**inputs, labels=labels)
    logits = evaluate(chain, inputs)
    assert (logits - out.logits).abs().max().item() <= 1e-5
    assert abs(chain.loss(logits, labels).item() - out.loss.item()) <= 1e-5

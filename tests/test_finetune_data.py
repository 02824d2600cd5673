"""Fine-tuning data: MRPC-style sentence pairs and WikiText-style language modelling, tokenized with the shipped
tokenizers, addressed by (step, micro-batch, rank) in a seeded order; bad files are refused naming the line."""

from pathlib import Path

import pytest
import torch

from chimera.data.finetune import (
    FinetuneDataError,
    language_model_data,
    load_tokenizer,
    read_pairs_tsv,
    read_wikitext,
    sentence_pair_data,
)

SAMPLE = Path(__file__).resolve().parents[1] / "chimera" / "data" / "sample"
BERT_TOK, GPT2_TOK = SAMPLE / "enwiki-sample.bert", SAMPLE / "enwiki-sample.gpt2"
HEADER = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
PAIRS = [(1, "The cat sat on the mat.", "A cat was sitting on the mat."),
         (0, "Stocks fell sharply today.", "The weather was sunny."),
         (1, "He bought a new car.", "A new car was bought by him."),
         (0, "The river is long.", "Apples are red."),
         (1, "She plays the piano.", "The piano is played by her."),
         (0, "Rain is expected.", "The museum opened in 1900.")]
WIKI = """ = Valkyria Chronicles = \n\n Senjou no Valkyria is a tactical role playing game .\n\n = = Gameplay = = \n
 The game is played in turns . Units move on a map .\n\n = Tower Building = \n\n The tower is a building in the city .\n"""


def _tsv(tmp_path, rows=PAIRS, header=HEADER, bom=True) -> Path:
    p = tmp_path / "pairs.tsv"
    body = "".join(f"{label}\t{i}\t{i + 100}\t{a}\t{b}\n" for i, (label, a, b) in enumerate(rows))
    p.write_text(("\ufeff" if bom else "") + header + body, encoding="utf-8")
    return p


def test_sentence_pairs_are_bert_pairs_in_a_seeded_order(tmp_path):
    rows = read_pairs_tsv(_tsv(tmp_path))
    assert [(r.label, r.first, r.second, r.line) for r in rows[:1]] == [(1, PAIRS[0][1], PAIRS[0][2], 2)]
    data = sentence_pair_data(_tsv(tmp_path), BERT_TOK, seq_len=24, num_labels=2)
    ds = data(micro_batch_size=1, seed=7, microbatches=2, data_parallel=3)  # one step = 6 samples = one epoch
    seen = []
    tok = load_tokenizer(BERT_TOK)
    for m in range(2):
        for r in range(3):
            inputs, labels = ds.get(0, m, r)
            ids = inputs["input_ids"][0]
            assert inputs["input_ids"].shape == (1, 24) and inputs["input_ids"].dtype == torch.long
            sep = (ids == tok.sep_token_id).nonzero().flatten().tolist()
            assert ids[0] == tok.cls_token_id and len(sep) == 2
            types = inputs["token_type_ids"][0]
            assert types[: sep[0] + 1].eq(0).all() and types[sep[0] + 1: sep[1] + 1].eq(1).all()
            assert inputs["attention_mask"][0].sum() == sep[1] + 1  # padded after the second [SEP]
            first = tok.decode(ids[1:sep[0]])
            i = next(k for k, (_, a, _) in enumerate(PAIRS) if tok.decode(tok(a)["input_ids"][1:-1]) == first)
            assert labels.tolist() == [PAIRS[i][0]]
            seen.append(i)
    assert sorted(seen) == list(range(6))  # every pair once per epoch
    again = data(1, 7, 2, 3)
    assert torch.equal(again.get(0, 1, 2)[0]["input_ids"], ds.get(0, 1, 2)[0]["input_ids"])
    order = [ds.sample_units(0, m, r)[0] for m in range(2) for r in range(3)]
    other = [data(1, 8, 2, 3).sample_units(0, m, r)[0] for m in range(2) for r in range(3)]
    assert sorted(other) == list(range(6)) and other != order  # another seed, another order of the same pairs
    with pytest.raises(IndexError, match="outside 2 micro-batches x 3 ranks"):
        ds.get(0, 2, 0)


@pytest.mark.parametrize("content,message", [
    ("Label\tA\tB\n1\tx\ty\n", r"line 1: header \['Label', 'A', 'B'\] is not MRPC's"),
    (HEADER + "1\t1\t2\tx\ty\n0\t3\tonly three\n", "line 3: 3 tab-separated columns, expected 5"),
    (HEADER + "1\t1\t2\tx\ty\nyes\t3\t4\tx\ty\n", r"line 3: label 'yes' in column 1 \(Quality\) is not an integer"),
    (HEADER + "1\t1\t2\t \ty\n", r"line 2: column 4 \(#1 String\) is empty"),
    (HEADER + "1\t1\t2\tx\ty\n\n2\t1\t2\tx\ty\n", r"line 4: label 2 in column 1 \(Quality\) is not below num_labels=2"),
    (HEADER, "a header and no rows"),
    ("", "empty file"),
])
def test_bad_pair_files_name_the_line(tmp_path, content, message):
    p = tmp_path / "bad.tsv"
    p.write_text(content)
    with pytest.raises(FinetuneDataError, match=message):
        sentence_pair_data(p, BERT_TOK, seq_len=16, num_labels=2)


def test_language_model_blocks_are_shifted_by_one(tmp_path):
    p = tmp_path / "wiki.txt"
    p.write_text(WIKI)
    articles = read_wikitext(p)
    assert len(articles) == 2 and articles[0].splitlines()[2] == "= = Gameplay = ="
    tok = load_tokenizer(GPT2_TOK)
    stream = []
    for a in articles:
        stream += tok(a)["input_ids"] + [tok.eos_token_id]
    data = language_model_data(p, GPT2_TOK, seq_len=8, vocab_size=8192)
    assert data.tokens.tolist() == stream
    blocks = (len(stream) - 1) // 8
    ds = data(micro_batch_size=blocks, seed=3)
    inputs, labels = ds.get(0, 0, 0)  # one micro-batch = one epoch: every block once
    starts = sorted(_find(stream, row.tolist()) for row in inputs["input_ids"])
    assert starts == [u * 8 for u in range(blocks)]
    assert torch.equal(labels["shift_labels"][:, :-1], inputs["input_ids"][:, 1:])
    for row, lab in zip(inputs["input_ids"], labels["shift_labels"]):
        s = _find(stream, row.tolist())
        assert lab[-1].item() == stream[s + 8]  # the block's extra token is the last label
    plain = language_model_data(p, GPT2_TOK, seq_len=8, shifted=False)(2, 3).get(1, 0, 0)
    assert torch.equal(plain[1]["labels"], plain[0]["input_ids"])


def _find(stream: list[int], row: list[int]) -> int:
    return next(i for i in range(0, len(stream) - len(row) + 1, 8) if stream[i:i + len(row)] == row)


@pytest.mark.parametrize("content,kwargs,message", [
    (" = Title = \n text\n = = Broken\n", {}, r"line 3: heading '= = Broken' is not closed; expected '= = Title = ='"),
    (" = T = \n a b\n", {"seq_len": 64}, "make no block of seq_len \\+ 1 = 65"),
    ("\n\n   \n", {}, "no text, only blank lines"),
    (" = T = \n a b c d e f g h i j\n", {"vocab_size": 100}, "has 8192 tokens, the model's vocabulary 100"),
])
def test_bad_text_files_are_refused(tmp_path, content, kwargs, message):
    p = tmp_path / "wiki.txt"
    p.write_text(content)
    with pytest.raises(FinetuneDataError, match=message):
        language_model_data(p, GPT2_TOK, **{"seq_len": 4, **kwargs})
    with pytest.raises(FinetuneDataError, match="no tokenizer"):
        load_tokenizer(tmp_path)

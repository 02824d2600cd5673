"""Real data: Wikipedia dump → segmented corpus → tokenizers → memory-mapped BERT / GPT-2 datasets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gensim
import numpy as np
import pytest
import torch

from chimera.cli import main
from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.data import CorpusBertDataset, TokenizedCorpus, load_info, permute, text_dataset
from chimera.data.corpus import SAMPLE_CORPUS, tokenized_dir
from chimera.data.tokenizer import build_tokenizers, load_tokenizer
from chimera.models import build_model

ROOT = Path(__file__).resolve().parents[1]
DUMP = (Path(gensim.__file__).parent / "test" / "test_data"
        / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")


def _documents(text: str) -> list[list[str]]:
    return [d.splitlines() for d in text.strip("\n").split("\n\n")]


def _bert(seq_len: int = 128, mbs: int = 8, n: int = 4, w: int = 2, seed: int = 0) -> CorpusBertDataset:
    model = build_model("bert-tiny", seq_len=seq_len, corpus="sample")
    ds = model.dataset(mbs, seed, microbatches=n, data_parallel=w)
    assert isinstance(ds, CorpusBertDataset)
    return ds


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("wiki") / "enwiki.txt"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_wikipedia.py"), str(DUMP), "-o", str(out),
                           "--workers", "2", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def test_prepare_wikipedia_extract(prepared) -> None:
    out, report = prepared
    docs = _documents(out.read_text(encoding="utf-8"))
    assert len(docs) >= 100
    assert sum(len(d) > 1 for d in docs) > 0.9 * len(docs)
    text = out.read_text(encoding="utf-8")
    for markup in ("[[", "{{", "<ref", "]]", "}}"):
        assert markup not in text
    assert all(line.strip() == line and line for d in docs for line in d)
    assert f"{len(docs)} documents, {sum(map(len, docs))} sentences" in report and "pages skipped" in report


def test_shipped_sample_is_the_prepared_extract_and_up_to_date(prepared) -> None:
    out, _ = prepared
    sample = SAMPLE_CORPUS.read_text(encoding="utf-8")
    assert _documents(sample) == _documents(out.read_text(encoding="utf-8"))[:len(_documents(sample))]
    total = sum(f.stat().st_size for f in SAMPLE_CORPUS.parent.rglob("*") if f.is_file())
    assert total < 3 * 2**20
    for family in ("bert", "gpt2"):
        assert load_info(SAMPLE_CORPUS, family).vocab_size == 8192  # fingerprint matches the shipped text


def test_tokenizer_command(tmp_path, capsys) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join("\n".join(d) for d in _documents(SAMPLE_CORPUS.read_text())[:2]) + "\n")
    assert main(["data", "tokenizer", str(corpus), "--family", "gpt2", "--vocab-size", "400", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "gpt2: 400 tokens in the vocabulary; 2 documents" in out and "c.gpt2" in out
    assert not tokenized_dir(corpus, "bert").exists()


def test_tokenizers_train_load_and_round_trip(tmp_path) -> None:
    from transformers import BertTokenizerFast, GPT2TokenizerFast

    docs = _documents(SAMPLE_CORPUS.read_text(encoding="utf-8"))[:3]
    corpus = tmp_path / "small.txt"
    corpus.write_text("\n\n".join("\n".join(d) for d in docs) + "\n", encoding="utf-8")
    infos = build_tokenizers(corpus, vocab_size=1000, progress=False)
    assert isinstance(load_tokenizer(corpus, "bert"), BertTokenizerFast)
    assert isinstance(load_tokenizer(corpus, "gpt2"), GPT2TokenizerFast)
    for family, info in infos.items():
        assert info.documents == 3 and info.sentences == sum(map(len, docs)) and info.vocab_size <= 1000
        assert (tokenized_dir(corpus, family) / "tokens.bin").stat().st_size == 2 * info.tokens
    gpt2 = load_tokenizer(corpus, "gpt2")
    tc = TokenizedCorpus(infos["gpt2"])
    first, end = tc.document_sentences(1)
    text = gpt2.decode(np.concatenate([tc.sentence(i) for i in range(first, end)]))
    assert text == " ".join(docs[1]) + "<|endoftext|>"
    bert = load_tokenizer(corpus, "bert")
    tb = TokenizedCorpus(infos["bert"])
    assert bert.decode(tb.sentence(0)).replace(" ", "") == docs[0][0].lower().replace(" ", "")


def test_permute_is_a_bijection() -> None:
    for n in (1, 2, 3, 7, 64, 1000):
        assert sorted(permute(i, n, 42) for i in range(n)) == list(range(n))
    assert [permute(i, 1000, 1) for i in range(10)] != [permute(i, 1000, 2) for i in range(10)]


def test_bert_masking_and_nsp_statistics() -> None:
    ds = _bert(seq_len=128, mbs=100, n=100, w=1, seed=7)  # 10,000 samples
    chosen = words = masked = kept = 0
    nsp = []
    for mb in range(100):
        inputs, labels = ds.get(0, mb, 0)
        ids, mlm, att = inputs["input_ids"], labels["labels"], inputs["attention_mask"]
        word = (att == 1) & (ids != ds.cls) & (ids != ds.sep)
        c = mlm != -100
        assert not (c & ~word).any() and (ids[att == 0] == ds.pad).all()
        chosen += int(c.sum())
        words += int(word.sum())
        masked += int((c & (ids == ds.mask)).sum())
        kept += int((c & (ids == mlm)).sum())
        nsp += labels["next_sentence_label"].tolist()
    assert abs(chosen / words - 0.15) <= 0.01
    assert abs(masked / chosen - 0.8) <= 0.01
    assert abs(kept / chosen - 0.1) <= 0.01
    assert abs(1 - (masked + kept) / chosen - 0.1) <= 0.01
    assert abs(sum(nsp) / len(nsp) - 0.5) <= 0.02


def test_bert_structure() -> None:
    inputs, labels = _bert(seq_len=64).get(3, 1, 1)
    ids, tt, att = inputs["input_ids"], inputs["token_type_ids"], inputs["attention_mask"]
    assert ids.shape == (8, 64) and (ids[:, 0] == 2).all()
    for row, t, a in zip(ids, tt, att):
        n = int(a.sum())
        seps = (row[:n] == 3).nonzero().flatten().tolist()
        assert len(seps) == 2 and seps[1] == n - 1 and 1 < seps[0] < n - 2
        assert t[:seps[0] + 1].eq(0).all() and t[seps[0] + 1:n].eq(1).all() and t[n:].eq(0).all()


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_same_address_same_samples_and_ranks_disjoint(family) -> None:
    def make():
        model = build_model("bert-tiny" if family == "bert" else "gpt2-tiny", seq_len=64)
        return text_dataset(family, model.vocab_size, 64, "sample", 4, 5, microbatches=4, data_parallel=2)

    a, b = make(), make()  # two workers
    ia, la = a.get(2, 3, 1)
    ib, lb = b.get(2, 3, 1)
    assert all(torch.equal(ia[k], ib[k]) for k in ia) and all(torch.equal(la[k], lb[k]) for k in la)
    units = [u for mb in range(4) for r in range(2) for u in a.sample_units(0, mb, r)]
    assert len(set(units)) == len(units)  # no two samples of a step share a start sentence / block
    r0, r1 = a.get(0, 0, 0)[0]["input_ids"], a.get(0, 0, 1)[0]["input_ids"]
    assert not any(torch.equal(x, y) for x in r0 for y in r1)


def test_default_config_reads_the_sample_and_takes_its_vocabulary() -> None:
    assert TrainConfig().model.corpus == "sample"
    assert compile_job(TrainConfig.from_flags(model="bert-mini", stages=2, micro_batches=2, partition="uniform")).chain.vocab_size == 8192
    assert compile_job(TrainConfig.from_flags(model="gpt2-small", stages=2, micro_batches=2, seq_len=64, partition="uniform")).chain.vocab_size == 8192
    assert compile_job(TrainConfig.from_flags(model="bert-mini", corpus="synthetic", stages=2, micro_batches=2, partition="uniform"
                                  )).chain.vocab_size == 30522
    with pytest.raises(ConfigError, match="contradicts the bert tokenizer"):
        compile_job(TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=2, model_overrides={"vocab_size": 500}, partition="uniform"))


def test_pipeline_reads_the_corpus_like_the_sequential_reference() -> None:
    from chimera.runtime import run_local, train_sequential

    cfg = TrainConfig.from_flags(model="gpt2-tiny", schedule="1f1b", stages=2, micro_batches=2, micro_batch_size=2,
                      data_parallel=2, seq_len=32, steps=2, optimizer="adamw", timeout_s=60, partition="uniform")
    ref = train_sequential(compile_job(cfg))
    for m, r in zip(run_local(compile_job(cfg)).metrics, ref.losses):
        assert abs(m["loss"] - r) <= 1e-6

"""Bad corpus input gives a clear message before any worker starts; BERT on the sample corpus learns on Ray."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from chimera.cli import main
from chimera.compile import compile_job
from chimera.config import ConfigError, TrainConfig
from chimera.data.corpus import SAMPLE_CORPUS, CorpusError, tokenized_dir
from chimera.data.tokenizer import build_tokenizers
from chimera.data.wiki import PrepareError, prepare_wikipedia

GARBAGE = os.urandom(4096) + b"\x00\xff\xfe"
CFG = TrainConfig.from_flags(model="bert-tiny", stages=2, micro_batches=2, micro_batch_size=2, seq_len=64, partition="uniform")


def _write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def _docs(n: int, sentences: int, words: int) -> str:
    return "\n\n".join("\n".join(" ".join(f"w{d}{s}{i % 7}" for i in range(words)) + "." for s in range(sentences))
                       for d in range(n)) + "\n"


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    (b"", "empty file"),
    (GARBAGE, "not a Wikipedia XML dump"),
    (b"<mediawiki><page><title>x</title></page>", "not a Wikipedia XML dump"),
])
def test_prepare_bad_input(tmp_path, capsys, content, message) -> None:
    dump = tmp_path / "dump.xml"
    if content is not None:
        _write(dump, content)
    with pytest.raises(PrepareError, match=message):
        prepare_wikipedia(dump, tmp_path / "out.txt", progress=False)
    assert not (tmp_path / "out.txt").exists()
    assert main(["data", "prepare", str(dump), "-o", str(tmp_path / "out.txt"), "--no-progress"]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    (b"", "empty file"),
    (b"\n\n\n", "no text, only blank lines"),
    (GARBAGE, "binary data, not UTF-8 text"),
    (("A sentence.\n" * 8000).encode() + b"\xff\xfe bad\n", "binary data, not UTF-8 text (line 8001)"),
    (_docs(1, 50, 8), "no document breaks"),
])
def test_tokenizer_bad_input(tmp_path, capsys, content, message) -> None:
    corpus = tmp_path / "c.txt"
    if content is not None:
        _write(corpus, content)
    with pytest.raises(CorpusError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_tokenizers(corpus, progress=False)
    assert main(["data", "tokenizer", str(corpus), "--no-progress"]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    (None, "--corpus: .* no such file"),
    (b"", "--corpus: .* empty file"),
    (GARBAGE, "--corpus: .* binary data, not UTF-8 text"),
    (_docs(3, 5, 6), "no bert tokenizer .* run: chimera data tokenizer"),
])
def test_config_refuses_bad_corpus(tmp_path, content, message) -> None:
    corpus = tmp_path / "c.txt"
    if content is not None:
        _write(corpus, content)
    with pytest.raises(ConfigError, match=message):
        compile_job(CFG.with_flags(corpus=str(corpus)))


def test_long_lines_are_an_error_or_a_counted_skip(tmp_path) -> None:
    corpus = _write(tmp_path / "long.txt", _docs(4, 20, 100))  # every line ~ 100 words: not sentence-split
    build_tokenizers(corpus, ["bert"], vocab_size=300, progress=False)
    with pytest.raises(ConfigError, match=r"80 of 80 sentences .* longer than 61 tokens .* raise --seq-len"):
        compile_job(CFG.with_flags(corpus=str(corpus)))
    with pytest.raises(ConfigError, match="longer than 13 tokens"):
        compile_job(CFG.with_flags(seq_len=16))  # the shipped sample with a tiny sequence
    with pytest.warns(UserWarning, match=r"\d+ of 5214 sentences .* longer than 61 tokens .* BERT samples skip them"):
        compile_job(CFG)


def test_changed_corpus_and_vocab_conflict(tmp_path) -> None:
    corpus = tmp_path / "s.txt"
    shutil.copy(SAMPLE_CORPUS, corpus)
    for family in ("bert", "gpt2"):
        shutil.copytree(tokenized_dir(SAMPLE_CORPUS, family), tokenized_dir(corpus, family))
    assert compile_job(CFG.with_flags(corpus=str(corpus), seq_len=128)).chain.vocab_size == 8192
    with open(corpus, "a", encoding="utf-8") as f:
        f.write("\nOne more document.\n")
    with pytest.raises(ConfigError, match="changed since it was tokenized"):
        compile_job(CFG.with_flags(corpus=str(corpus)))


@pytest.mark.ray
def test_bert_on_sample_corpus_learns_on_ray(ray_session) -> None:
    from ray_launch.recovery import run

    cfg = TrainConfig.from_flags(model="bert-tiny", corpus="sample", schedule="chimera", stages=2, micro_batches=2,
                      micro_batch_size=8, seq_len=64, steps=30, optimizer="adamw", lr=2e-3, timeout_s=60, partition="uniform")
    losses = [r["loss"] for r in run(compile_job(cfg), progress=False)]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, losses

"""A tokenized corpus on disk, read through ``numpy.memmap`` so that every worker shares the page cache.

For a segmented corpus ``X.txt`` (one sentence per line, a blank line between documents) the command
``chimera data tokenizer X.txt`` writes, per model family, a folder ``X.bert/`` / ``X.gpt2/`` with

* ``tokenizer.json``, ``tokenizer_config.json``: the trained tokenizer (transformers' fast tokenizer),
* ``tokens.bin``: every sentence's token ids, concatenated (``uint16``, or ``uint32`` for big vocabularies),
* ``sentences.bin``: ``int64`` start offset of each sentence in ``tokens.bin``, plus the end,
* ``documents.bin``: ``int64`` index of each document's first sentence, plus the end,
* ``meta.json``: counts, dtype, special-token ids, the corpus fingerprint and a sentence-length histogram.

GPT-2 sentences carry a leading space (except a document's first) and each document ends with
``<|endoftext|>``, so ``tokens.bin`` is the running text the model is trained on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("bert", "gpt2")
FORMAT_VERSION = 1
SAMPLE_CORPUS = Path(__file__).resolve().parent / "sample" / "enwiki-sample.txt"
SYNTHETIC = "synthetic"
SAMPLE = "sample"
LENGTH_BINS = 1024  # sentence-length histogram: exact counts below, one overflow bin at LENGTH_BINS
_SNIFF_BYTES = 1 << 16
_FINGERPRINT_BYTES = 1 << 20


class CorpusError(ValueError):
    """A corpus that cannot be used; the message says what to do."""


def resolve_corpus(spec: str | Path | None) -> Path | None:
    """``"synthetic"`` / ``None`` → ``None`` (random tokens); ``"sample"`` → the shipped corpus; else a path."""
    if spec is None or str(spec) == SYNTHETIC:
        return None
    if str(spec) == SAMPLE:
        return SAMPLE_CORPUS
    return Path(spec).expanduser()


def tokenized_dir(corpus: Path, family: str) -> Path:
    """The folder next to ``corpus`` that holds its ``family`` tokenizer and token files."""
    return corpus.with_name(f"{corpus.stem}.{family}")


def fingerprint(corpus: Path) -> dict[str, Any]:
    """Size and SHA-256 of the first MiB: cheap, and catches an edited or replaced corpus."""
    with open(corpus, "rb") as f:
        head = f.read(_FINGERPRINT_BYTES)
    return {"bytes": corpus.stat().st_size, "sha256_head": hashlib.sha256(head).hexdigest()}


def check_text_file(corpus: Path) -> None:
    """Raise :class:`CorpusError` for a missing, empty or binary file (reads only its first 64 KiB)."""
    if not corpus.exists():
        raise CorpusError(f"{corpus}: no such file")
    if not corpus.is_file():
        raise CorpusError(f"{corpus}: not a file (expected a text corpus, one sentence per line)")
    if corpus.stat().st_size == 0:
        raise CorpusError(f"{corpus}: empty file (expected one sentence per line, a blank line between documents)")
    with open(corpus, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    bad = b"\x00" in head
    if not bad:
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as e:
            bad = e.start < len(head) - 3  # a multi-byte character cut at the end of the sniffed block is fine
    if bad:
        raise CorpusError(f"{corpus}: binary data, not UTF-8 text (expected one sentence per line, "
                          "a blank line between documents)")


@dataclass(frozen=True)
class CorpusInfo:
    """``meta.json`` of one tokenized corpus."""

    path: Path
    family: str
    meta: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def documents(self) -> int:
        return int(self.meta["documents"])

    @property
    def sentences(self) -> int:
        return int(self.meta["sentences"])

    @property
    def tokens(self) -> int:
        return int(self.meta["tokens"])

    @property
    def special(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.meta["special"].items()}

    def longer_than(self, n: int) -> int:
        """Number of sentences with more than ``n`` tokens."""
        hist = self.meta["sentence_lengths"]
        return int(sum(hist[n + 1:])) if n + 1 < len(hist) else 0


def load_info(corpus: Path, family: str) -> CorpusInfo:
    """Validate ``corpus`` and its tokenized folder for ``family``; raise :class:`CorpusError` with the fix."""
    check_text_file(corpus)
    folder = tokenized_dir(corpus, family)
    meta_path = folder / "meta.json"
    fix = f"run: chimera data tokenizer {corpus}"
    if not meta_path.is_file():
        raise CorpusError(f"{corpus}: no {family} tokenizer and token files next to it ({folder}/ is missing); {fix}")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise CorpusError(f"{folder}: format {meta.get('format')}, expected {FORMAT_VERSION}; {fix}")
    if meta.get("corpus") != fingerprint(corpus):
        raise CorpusError(f"{corpus} changed since it was tokenized into {folder}/; {fix}")
    for name in ("tokens.bin", "sentences.bin", "documents.bin", "tokenizer.json"):
        if not (folder / name).is_file():
            raise CorpusError(f"{folder}/{name} is missing; {fix}")
    return CorpusInfo(corpus, family, meta)


class TokenizedCorpus:
    """Memory-mapped token ids, sentence and document offsets of one tokenized corpus."""

    def __init__(self, info: CorpusInfo) -> None:
        self.info = info
        self.folder = tokenized_dir(info.path, info.family)

    def _map(self, name: str, dtype: str, count: int) -> np.ndarray:
        arr = np.memmap(self.folder / name, dtype=np.dtype(dtype), mode="r")
        if arr.shape[0] != count:
            raise CorpusError(f"{self.folder}/{name}: {arr.shape[0]} entries, meta.json says {count}; "
                              f"run: chimera data tokenizer {self.info.path}")
        return arr

    # mapped lazily: a memmap is opened in the process that reads it, never pickled across processes
    @cached_property
    def tokens(self) -> np.ndarray:
        return self._map("tokens.bin", self.info.meta["dtype"], self.info.tokens)

    @cached_property
    def sentence_starts(self) -> np.ndarray:
        return self._map("sentences.bin", "<i8", self.info.sentences + 1)

    @cached_property
    def document_starts(self) -> np.ndarray:
        return self._map("documents.bin", "<i8", self.info.documents + 1)

    def sentence(self, i: int) -> np.ndarray:
        """Token ids of sentence ``i`` (a view into the map)."""
        return self.tokens[self.sentence_starts[i]:self.sentence_starts[i + 1]]

    def sentence_len(self, i: int) -> int:
        return int(self.sentence_starts[i + 1] - self.sentence_starts[i])

    def document_of(self, sentence: int) -> int:
        """Index of the document that holds ``sentence`` (binary search in the map)."""
        return int(np.searchsorted(self.document_starts, sentence, side="right")) - 1

    def document_sentences(self, doc: int) -> tuple[int, int]:
        """``[first, end)`` sentence indices of document ``doc``."""
        return int(self.document_starts[doc]), int(self.document_starts[doc + 1])

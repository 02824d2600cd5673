"""Train tokenizers on a segmented corpus and tokenize it once into memory-mappable files.

WordPiece (BERT, lower-cased, ``[PAD] [UNK] [CLS] [SEP] [MASK]`` = ids 0..4) and byte-level BPE (GPT-2,
``<|endoftext|>`` = id 0) are trained with ``tokenizers``, saved next to the corpus and loaded with
transformers' fast tokenizer classes::

    infos = build_tokenizers("wikipedia.segmented.txt", vocab_size=30522)
    tok = load_tokenizer("wikipedia.segmented.txt", "bert")       # a BertTokenizerFast
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from chimera.data.corpus import (
    FAMILIES,
    FORMAT_VERSION,
    LENGTH_BINS,
    CorpusError,
    CorpusInfo,
    check_text_file,
    fingerprint,
    load_info,
    tokenized_dir,
)

BERT_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
GPT2_EOT = "<|endoftext|>"
ENCODE_LINES = 8192  # lines per encode batch (the Rust tokenizer parallelises within a batch)


@dataclass
class ScanStats:
    """What one pass over the corpus found."""

    lines: int = 0
    documents: int = 0
    bytes: int = 0


def _lines(corpus: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` with a clear error for bytes that are not UTF-8 text."""
    with open(corpus, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                if b"\x00" in raw:
                    raise UnicodeDecodeError("utf-8", raw, raw.index(b"\x00"), raw.index(b"\x00") + 1, "NUL byte")
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CorpusError(f"{corpus}: binary data, not UTF-8 text (line {n}); expected one sentence per "
                                  "line, a blank line between documents") from None


def scan_corpus(corpus: str | Path, progress: bool = False) -> ScanStats:
    """Check the whole corpus (UTF-8, at least two documents); count sentences and documents."""
    corpus = Path(corpus)
    check_text_file(corpus)
    st = ScanStats()
    in_doc = False
    size = corpus.stat().st_size
    with tqdm(total=size, unit="B", unit_scale=True, desc=f"check {corpus.name}", disable=not progress) as bar:
        for _, line in _lines(corpus):
            bar.update(len(line.encode("utf-8")))
            if line.strip():
                st.lines += 1
                st.documents += not in_doc
                in_doc = True
            else:
                in_doc = False
    st.bytes = size
    if st.lines == 0:
        raise CorpusError(f"{corpus}: no text, only blank lines")
    if st.documents < 2:
        raise CorpusError(f"{corpus}: no document breaks ({st.lines} lines, one document); expected one sentence "
                          "per line and a blank line between documents (chimera data prepare writes this format)")
    return st


def _train(corpus: Path, family: str, vocab_size: int, min_frequency: int) -> Any:
    from tokenizers.implementations import BertWordPieceTokenizer, ByteLevelBPETokenizer

    if family == "bert":
        tok = BertWordPieceTokenizer(lowercase=True)
        tok.train([str(corpus)], vocab_size=vocab_size, min_frequency=min_frequency,
                  special_tokens=list(BERT_SPECIAL), show_progress=False)
    else:
        tok = ByteLevelBPETokenizer(add_prefix_space=False)
        tok.train([str(corpus)], vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[GPT2_EOT],
                  show_progress=False)
    return tok


def _fast_class(family: str) -> Any:
    from transformers import BertTokenizerFast, GPT2TokenizerFast

    return BertTokenizerFast if family == "bert" else GPT2TokenizerFast


def load_tokenizer(corpus: str | Path, family: str) -> Any:
    """The trained tokenizer of ``corpus`` as ``BertTokenizerFast`` or ``GPT2TokenizerFast``."""
    folder = tokenized_dir(Path(corpus), family)
    if not (folder / "tokenizer.json").is_file():
        raise CorpusError(f"{corpus}: no {family} tokenizer ({folder}/tokenizer.json); "
                          f"run: chimera data tokenizer {corpus}")
    return _fast_class(family).from_pretrained(str(folder), local_files_only=True)


class _Encoder:
    """Writes tokens.bin, sentences.bin and documents.bin batch by batch (:meth:`flush`) and counts what it wrote."""

    def __init__(self, family: str, tok: Any, dtype: np.dtype, files: tuple[Any, Any, Any]) -> None:
        self.family, self.tok, self.dtype = family, tok, dtype
        self.ft, self.fs, self.fd = files
        self.eot = tok.convert_tokens_to_ids(GPT2_EOT) if family == "gpt2" else None
        self.hist = np.zeros(LENGTH_BINS + 1, dtype=np.int64)
        self.pos = self.sentences = self.documents = self.dropped = 0
        self.pending: list[str] = []
        # flags per pending line: starts a document / ends one (gpt2 appends <|endoftext|> to the last sentence)
        self.starts: list[bool] = []
        self.ends: list[bool] = []

    def add(self, text: str, starts_document: bool) -> None:
        """Queue one line; encode the queue first when it is full (keeping its last line, which may still end its
        document)."""
        if len(self.pending) >= ENCODE_LINES:
            keep = (self.pending.pop(), self.starts.pop(), self.ends.pop())
            self.flush()
            self.pending.append(keep[0]), self.starts.append(keep[1]), self.ends.append(keep[2])
        self.pending.append(text)
        self.starts.append(starts_document)
        self.ends.append(False)

    def end_document(self) -> None:
        if self.ends:
            self.ends[-1] = True

    def flush(self) -> None:
        """Encode the queued lines and append them to the files."""
        eot = self.eot
        texts = [(" " + t if self.family == "gpt2" and not s else t) for t, s in zip(self.pending, self.starts)]
        ids = self.tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        out_tokens: list[np.ndarray] = []
        out_starts: list[int] = []
        out_docs: list[int] = []
        for seq, first, last in zip(ids, self.starts, self.ends):
            if first:
                out_docs.append(self.sentences)
                self.documents += 1
            if not seq and not (last and eot is not None):
                self.dropped += 1  # nothing the tokenizer keeps (e.g. only control characters)
                continue
            n = len(seq) + (1 if last and eot is not None else 0)
            out_starts.append(self.pos)
            out_tokens.append(np.asarray(seq + ([eot] if last and eot is not None else []), dtype=self.dtype))
            self.hist[min(len(seq), LENGTH_BINS)] += 1
            self.pos += n
            self.sentences += 1
        if out_tokens:
            self.ft.write(np.concatenate(out_tokens).tobytes())
        self.fs.write(np.asarray(out_starts, dtype="<i8").tobytes())
        self.fd.write(np.asarray(out_docs, dtype="<i8").tobytes())
        self.pending.clear()
        self.starts.clear()
        self.ends.clear()

    def close(self) -> None:
        """The last batch, and each offsets file's end marker."""
        self.end_document()
        self.flush()
        self.fs.write(np.asarray([self.pos], dtype="<i8").tobytes())
        self.fd.write(np.asarray([self.sentences], dtype="<i8").tobytes())


def _encode(corpus: Path, family: str, tok: Any, folder: Path, dtype: np.dtype, progress: bool) -> dict[str, Any]:
    """Write tokens.bin, sentences.bin and documents.bin; return the counts for meta.json."""
    in_doc = False
    with open(folder / "tokens.bin", "wb") as ft, open(folder / "sentences.bin", "wb") as fs, \
            open(folder / "documents.bin", "wb") as fd, \
            tqdm(total=corpus.stat().st_size, unit="B", unit_scale=True, desc=f"tokenize {family}",
                 disable=not progress) as bar:
        enc = _Encoder(family, tok, dtype, (ft, fs, fd))
        for _, line in _lines(corpus):
            bar.update(len(line.encode("utf-8")))
            text = line.strip()
            if not text:
                enc.end_document()
                in_doc = False
                continue
            enc.add(text, not in_doc)
            in_doc = True
        enc.close()
    documents = enc.documents
    # documents whose sentences were all dropped would be empty: keep the count honest
    docs = np.fromfile(folder / "documents.bin", dtype="<i8")
    keep = np.diff(docs) > 0
    if not keep.all():
        np.concatenate([docs[:-1][keep], docs[-1:]]).astype("<i8").tofile(folder / "documents.bin")
        documents = int(keep.sum())
    hist = enc.hist
    last = int(np.nonzero(hist)[0].max()) + 1 if hist.any() else 1
    return {"tokens": enc.pos, "sentences": enc.sentences, "documents": documents, "dropped_lines": enc.dropped,
            "sentence_lengths": hist[:last].tolist()}


def build_tokenizers(corpus: str | Path, families: Sequence[str] = FAMILIES, *, vocab_size: int = 8192,
                     min_frequency: int = 2, progress: bool = True) -> dict[str, CorpusInfo]:
    """Train one tokenizer per family on ``corpus`` and tokenize the corpus with it (see :mod:`chimera.data.corpus`)."""
    corpus = Path(corpus)
    for family in families:
        if family not in FAMILIES:
            raise CorpusError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    if vocab_size < 256 + len(BERT_SPECIAL):
        raise CorpusError(f"vocab size must be at least {256 + len(BERT_SPECIAL)}, got {vocab_size}")
    scan = scan_corpus(corpus, progress)
    out = {}
    for family in families:
        folder = tokenized_dir(corpus, family)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        raw = _train(corpus, family, vocab_size, min_frequency)
        raw.save(str(folder / "tokenizer.json"))
        tok = _fast_class(family)(tokenizer_file=str(folder / "tokenizer.json"))
        tok.save_pretrained(str(folder))
        tok = load_tokenizer(corpus, family)
        dtype = np.dtype("<u2") if len(tok) <= 1 << 16 else np.dtype("<u4")
        counts = _encode(corpus, family, tok, folder, dtype, progress)
        special = ({name: tok.convert_tokens_to_ids(name) for name in BERT_SPECIAL} if family == "bert"
                   else {GPT2_EOT: tok.convert_tokens_to_ids(GPT2_EOT)})
        meta = {"format": FORMAT_VERSION, "family": family, "vocab_size": len(tok), "dtype": dtype.str,
                "special": special, "corpus": fingerprint(corpus), "corpus_documents": scan.documents,
                **counts}
        (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        out[family] = load_info(corpus, family)
    return out

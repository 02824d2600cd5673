"""Fine-tuning data: sentence-pair classification (GLUE TSV, MRPC's layout) and language modelling (WikiText text).

Both are tokenized once, where they are made (the tokens travel with the job, the workers only index them),
and give micro-batches addressed by ``(step, micro_batch, data_parallel_rank)``: sample ``b`` of micro-batch
``m`` of rank ``r`` in step ``t`` is ``((t * N + m) * W + r) * B + b``, and epoch ``e`` visits every example
(or block) once in a pseudo-random order keyed by ``(seed, e)``, as the pretraining datasets do.

Usage::

    data = sentence_pair_data("msr_paraphrase_train.txt", "chimera/data/sample/enwiki-sample.bert", seq_len=128)
    data(micro_batch_size=8, seed=0, microbatches=4).get(0, 0, 0)   # ({input_ids, token_type_ids, attention_mask}, labels)
    lm = language_model_data("wiki.train.tokens", "chimera/data/sample/enwiki-sample.gpt2", seq_len=128)

A ``*Data`` object is a chain's data factory (``LayerChain(data=...)``): ``data(B, seed, N, W)`` -> the dataset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chimera.data.base import mix_seed, permute
from chimera.data.corpus import CorpusError, check_text_file

PAIR_HEADER = ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String")


class FinetuneDataError(ValueError):
    """A fine-tuning file that cannot be read; names the file, the line and what is wrong."""


@dataclass(frozen=True)
class PairExample:
    """One row of a sentence-pair TSV: its label, the two sentences and its line number."""

    label: int
    first: str
    second: str
    line: int


def load_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` itself, or the transformers fast tokenizer saved in that directory (local files only)."""
    if not isinstance(tokenizer, str | Path):
        return tokenizer
    from transformers import AutoTokenizer

    p = Path(tokenizer)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise FinetuneDataError(f"{p}: no tokenizer (tokenizer.json / tokenizer_config.json); give a directory saved "
                                "with tokenizer.save_pretrained, e.g. chimera/data/sample/enwiki-sample.bert")
    return AutoTokenizer.from_pretrained(str(p), local_files_only=True)


def _check_vocab(tok: Any, vocab_size: int | None) -> None:
    if vocab_size is not None and len(tok) > vocab_size:
        raise FinetuneDataError(f"the tokenizer {getattr(tok, 'name_or_path', '')!r} has {len(tok)} tokens, the model's "
                                f"vocabulary {vocab_size}; use the model's own tokenizer")


def read_pairs_tsv(path: str | Path) -> list[PairExample]:
    """The rows of a GLUE sentence-pair TSV in MRPC's layout (header ``Quality  #1 ID  #2 ID  #1 String  #2 String``,
    tab-separated, the integer label in column 1); :class:`FinetuneDataError` names the line and the column."""
    p = Path(path)
    _check_text(p, "a tab-separated file with the header " + "\\t".join(PAIR_HEADER))
    rows: list[PairExample] = []
    with open(p, encoding="utf-8-sig") as f:
        header = f.readline().rstrip("\r\n").split("\t")
        if tuple(h.strip() for h in header) != PAIR_HEADER:
            raise FinetuneDataError(f"{p} line 1: header {header} is not MRPC's; expected the tab-separated columns "
                                    f"{list(PAIR_HEADER)}")
        for n, raw in enumerate(f, 2):
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            cols = line.split("\t")
            if len(cols) != len(PAIR_HEADER):
                raise FinetuneDataError(f"{p} line {n}: {len(cols)} tab-separated columns, expected "
                                        f"{len(PAIR_HEADER)} ({', '.join(PAIR_HEADER)})")
            try:
                label = int(cols[0])
            except ValueError:
                raise FinetuneDataError(f"{p} line {n}: label {cols[0]!r} in column 1 (Quality) is not an "
                                        "integer") from None
            if label < 0:
                raise FinetuneDataError(f"{p} line {n}: label {label} in column 1 (Quality) is negative")
            for col in (3, 4):
                if not cols[col].strip():
                    raise FinetuneDataError(f"{p} line {n}: column {col + 1} ({PAIR_HEADER[col]}) is empty")
            rows.append(PairExample(label, cols[3], cols[4], n))
    if not rows:
        raise FinetuneDataError(f"{p}: a header and no rows")
    return rows


def read_wikitext(path: str | Path) -> list[str]:
    """The articles of a WikiText-style text file: an article starts at a `` = Title = `` line, `` = = Section = = ``
    lines and paragraphs follow; every article is its non-blank lines, stripped, joined by newlines."""
    p = Path(path)
    _check_text(p, "WikiText's layout: ' = Title = ' lines, ' = = Section = = ' lines and paragraphs")
    articles: list[list[str]] = []
    with open(p, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            level = _heading_level(line, p, n)
            if level == 1 or not articles:
                articles.append([])
            articles[-1].append(line)
    if not articles:
        raise FinetuneDataError(f"{p}: no text, only blank lines")
    return ["\n".join(a) for a in articles]


def _heading_level(line: str, path: Path, n: int) -> int:
    """0 for a paragraph, k for a heading with k ``=`` on each side (``= = Section = =``: 2); unclosed: an error."""
    words = line.split(" ")
    if words[0] != "=":
        return 0
    k = next((i for i, w in enumerate(words) if w != "="), len(words))
    if len(words) <= 2 * k or words[-k:] != ["="] * k:
        marks = " ".join(["="] * k)
        raise FinetuneDataError(f"{path} line {n}: heading {line!r} is not closed; expected '{marks} Title {marks}'")
    return k


def _check_text(p: Path, layout: str) -> None:
    try:
        check_text_file(p)
    except CorpusError as e:
        raise FinetuneDataError(f"{str(e).split(' (expected')[0]} (expected {layout})") from None


class _Addressed:
    """Sample numbering and the keyed per-epoch order shared by the fine-tuning datasets."""

    def __init__(self, units: int, micro_batch_size: int, seed: int, microbatches: int, data_parallel: int) -> None:
        if min(micro_batch_size, microbatches, data_parallel) < 1:
            raise ValueError(f"micro_batch_size, microbatches and data_parallel must be >= 1, got {micro_batch_size}, "
                             f"{microbatches}, {data_parallel}")
        self.units, self.micro_batch_size, self.seed = units, micro_batch_size, seed
        self.microbatches, self.data_parallel = microbatches, data_parallel

    def sample_units(self, step: int, microbatch: int, dp_rank: int) -> list[int]:
        """The example (or block) index of every sample of one micro-batch."""
        if not (0 <= microbatch < self.microbatches and 0 <= dp_rank < self.data_parallel and step >= 0):
            raise IndexError(f"address (step {step}, micro-batch {microbatch}, rank {dp_rank}) outside "
                             f"{self.microbatches} micro-batches x {self.data_parallel} ranks")
        out = []
        for b in range(self.micro_batch_size):
            s = ((step * self.microbatches + microbatch) * self.data_parallel + dp_rank) * self.micro_batch_size + b
            epoch, i = divmod(s, self.units)
            out.append(permute(i, self.units, mix_seed(self.seed, epoch)))
        return out


class SentencePairDataset(_Addressed):
    """Tokenized sentence pairs: ``get`` -> ``({input_ids, token_type_ids, attention_mask} [B,S], labels [B])``."""

    def __init__(self, encoded: dict[str, torch.Tensor], labels: torch.Tensor, micro_batch_size: int, seed: int = 0,
                 microbatches: int = 1, data_parallel: int = 1) -> None:
        super().__init__(len(labels), micro_batch_size, seed, microbatches, data_parallel)
        self.encoded, self.labels = encoded, labels

    def get(self, step: int, microbatch: int, dp_rank: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        idx = torch.tensor(self.sample_units(step, microbatch, dp_rank))
        return {k: v[idx].long() for k, v in self.encoded.items()}, self.labels[idx]


class SentencePairData:
    """A chain's data factory over tokenized pairs: ``data(B, seed, N, W)`` -> :class:`SentencePairDataset`."""

    def __init__(self, encoded: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        self.encoded, self.labels = encoded, labels

    @property
    def seq_len(self) -> int:
        return int(self.encoded["input_ids"].shape[1])

    def __call__(self, micro_batch_size: int, seed: int = 0, microbatches: int = 1, data_parallel: int = 1
                 ) -> SentencePairDataset:
        return SentencePairDataset(self.encoded, self.labels, micro_batch_size, seed, microbatches, data_parallel)


def sentence_pair_data(tsv: str | Path, tokenizer: Any, seq_len: int, num_labels: int | None = None,
                       vocab_size: int | None = None) -> SentencePairData:
    """Read ``tsv`` (:func:`read_pairs_tsv`) and tokenize every pair as BERT does (``[CLS] A [SEP] B [SEP]``, cut to
    ``seq_len`` longest-first, padded); ``num_labels``: refuse labels outside ``[0, num_labels)``; ``vocab_size``:
    refuse a tokenizer with more tokens than the model."""
    rows = read_pairs_tsv(tsv)
    if num_labels is not None:
        bad = next((r for r in rows if r.label >= num_labels), None)
        if bad is not None:
            raise FinetuneDataError(f"{tsv} line {bad.line}: label {bad.label} in column 1 (Quality) is not below "
                                    f"num_labels={num_labels}")
    tok = load_tokenizer(tokenizer)
    _check_vocab(tok, vocab_size)
    enc = tok([r.first for r in rows], [r.second for r in rows], truncation="longest_first", max_length=seq_len,
              padding="max_length", return_tensors="pt")
    encoded = {k: enc[k].to(torch.int32) for k in ("input_ids", "token_type_ids", "attention_mask") if k in enc}
    return SentencePairData(encoded, torch.tensor([r.label for r in rows], dtype=torch.long))


class LanguageModelDataset(_Addressed):
    """Blocks of ``seq_len + 1`` tokens (block ``u`` starts at token ``u * seq_len``): inputs are the first ``seq_len``
    tokens, labels ``{"shift_labels": the last seq_len}`` (every position predicts its next token), or with
    ``shifted=False`` ``{"labels": the inputs}`` for a loss that shifts them itself."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, micro_batch_size: int, seed: int = 0,
                 microbatches: int = 1, data_parallel: int = 1, shifted: bool = True) -> None:
        blocks = (len(tokens) - 1) // seq_len if seq_len >= 1 else 0
        if blocks < 1:
            raise FinetuneDataError(f"{len(tokens)} tokens make no block of seq_len + 1 = {seq_len + 1}; use more text "
                                    "or a smaller seq_len")
        super().__init__(blocks, micro_batch_size, seed, microbatches, data_parallel)
        self.tokens, self.seq_len, self.shifted = tokens, seq_len, shifted

    def get(self, step: int, microbatch: int, dp_rank: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        s = self.seq_len
        block = torch.stack([self.tokens[u * s:u * s + s + 1] for u in self.sample_units(step, microbatch, dp_rank)])
        block = block.long()
        inputs = {"input_ids": block[:, :-1], "attention_mask": torch.ones_like(block[:, :-1])}
        labels = {"shift_labels": block[:, 1:].contiguous()} if self.shifted else {"labels": block[:, :-1].clone()}
        return inputs, labels


class LanguageModelData:
    """A chain's data factory over a token stream: ``data(B, seed, N, W)`` -> :class:`LanguageModelDataset`."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, shifted: bool = True) -> None:
        self.tokens, self.seq_len, self.shifted = tokens, seq_len, shifted
        LanguageModelDataset(tokens, seq_len, 1, shifted=shifted)  # at least one block

    def __call__(self, micro_batch_size: int, seed: int = 0, microbatches: int = 1, data_parallel: int = 1
                 ) -> LanguageModelDataset:
        return LanguageModelDataset(self.tokens, self.seq_len, micro_batch_size, seed, microbatches, data_parallel,
                                    self.shifted)


def language_model_data(text_file: str | Path, tokenizer: Any, seq_len: int, shifted: bool = True,
                        vocab_size: int | None = None) -> LanguageModelData:
    """Read ``text_file`` (:func:`read_wikitext`), tokenize every article once and join them into one stream, the
    tokenizer's end-of-text token (if it has one) after each article; cut into blocks by the dataset.
    ``vocab_size``: the model's; refused when the tokenizer has more tokens."""
    tok = load_tokenizer(tokenizer)
    _check_vocab(tok, vocab_size)
    articles = read_wikitext(text_file)
    ids: list[int] = []
    for encoded in tok(articles, verbose=False)["input_ids"]:
        ids.extend(encoded)
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    dtype = torch.int32 if len(tok) >= 1 << 15 else torch.int16
    return LanguageModelData(torch.tensor(ids, dtype=dtype), seq_len, shifted)

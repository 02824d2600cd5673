"""BERT (MLM + NSP) and GPT-2 (causal LM) datasets over a memory-mapped tokenized corpus.

Samples are numbered in the order the run consumes them: sample ``b`` of micro-batch ``m`` of data-parallel
rank ``r`` in step ``t`` is ``((t * N + m) * W + r) * B + b``. Epoch ``e`` visits every unit (a start
sentence for BERT, a block for GPT-2) once, in a pseudo-random order keyed by ``(seed, e)``, so ranks and
micro-batches of one epoch never share a unit, and every process computes the same sample for an address.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from chimera.data.base import AddressedDataset, Batch, address_generator, mix_seed, permute
from chimera.data.corpus import CorpusError, CorpusInfo, TokenizedCorpus

MLM_PROB = 0.15
SHORT_SEQ_PROB = 0.1  # as in BERT's create_pretraining_data: sometimes train on shorter pairs
_MAX_TRIES = 100


class _CorpusDataset(AddressedDataset):
    """Sample numbering and unit permutation shared by the corpus datasets."""

    units: int

    def __init__(self, corpus: TokenizedCorpus, seq_len: int, micro_batch_size: int, seed: int,
                 microbatches: int, data_parallel: int) -> None:
        super().__init__(corpus.info.vocab_size, seq_len, micro_batch_size, seed)
        if microbatches < 1 or data_parallel < 1:
            raise ValueError(f"microbatches and data_parallel must be >= 1, got {microbatches}, {data_parallel}")
        self.corpus = corpus
        self.microbatches = microbatches
        self.data_parallel = data_parallel

    def sample_index(self, step: int, microbatch: int, dp_rank: int, b: int) -> int:
        if not (0 <= microbatch < self.microbatches and 0 <= dp_rank < self.data_parallel and step >= 0):
            raise IndexError(f"address (step {step}, micro-batch {microbatch}, rank {dp_rank}) outside "
                             f"{self.microbatches} micro-batches x {self.data_parallel} ranks")
        return ((step * self.microbatches + microbatch) * self.data_parallel + dp_rank) * self.micro_batch_size + b

    def sample_units(self, step: int, microbatch: int, dp_rank: int) -> list[int]:
        """The unit (start sentence or block) of every sample of one micro-batch."""
        out = []
        for b in range(self.micro_batch_size):
            s = self.sample_index(step, microbatch, dp_rank, b)
            epoch, i = divmod(s, self.units)
            out.append(permute(i, self.units, mix_seed(self.seed, epoch)))
        return out


class CorpusGPT2Dataset(_CorpusDataset):
    """Blocks of ``seq_len`` consecutive tokens of the running text (documents end with ``<|endoftext|>``)."""

    def __init__(self, corpus: TokenizedCorpus, seq_len: int = 1024, micro_batch_size: int = 1, seed: int = 0,
                 microbatches: int = 1, data_parallel: int = 1) -> None:
        super().__init__(corpus, seq_len, micro_batch_size, seed, microbatches, data_parallel)
        self.units = corpus.info.tokens // seq_len
        if self.units < 1:
            raise CorpusError(f"{corpus.info.path}: {corpus.info.tokens} tokens, fewer than one sequence of "
                              f"{seq_len}; use a bigger corpus or a smaller --seq-len")

    def get(self, step: int, microbatch: int, dp_rank: int = 0) -> tuple[Batch, Batch]:
        tokens, s = self.corpus.tokens, self.seq_len
        rows = [np.asarray(tokens[u * s:(u + 1) * s], dtype=np.int64) for u in self.sample_units(step, microbatch, dp_rank)]
        ids = torch.from_numpy(np.stack(rows))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {"labels": ids.clone()}


class CorpusBertDataset(_CorpusDataset):
    """``[CLS] A [SEP] B [SEP]`` sentence pairs with MLM (15 %, 80/10/10) and NSP (50 % random B) labels.

    Segment A is one or more consecutive sentences from a start sentence; B is the actual continuation
    (label 0) or text from another document (label 1). Sentences longer than ``seq_len - 3`` tokens are
    skipped; a pair longer than that is cut from A's front and B's back. Of the non-special tokens,
    ``round(0.15 n)`` (at least 1) are predicted: 80 % become ``[MASK]``, 10 % a random word, 10 % stay.
    """

    def __init__(self, corpus: TokenizedCorpus, seq_len: int = 128, micro_batch_size: int = 1, seed: int = 0,
                 microbatches: int = 1, data_parallel: int = 1) -> None:
        super().__init__(corpus, seq_len, micro_batch_size, seed, microbatches, data_parallel)
        if seq_len < 8:
            raise CorpusError(f"BERT pretraining needs --seq-len >= 8, got {seq_len}")
        if corpus.info.documents < 2:
            raise CorpusError(f"{corpus.info.path}: one document only; next-sentence prediction needs at least two")
        sp = corpus.info.special
        self.pad, self.cls, self.sep, self.mask = sp["[PAD]"], sp["[CLS]"], sp["[SEP]"], sp["[MASK]"]
        self.first_word = max(sp.values()) + 1
        self.max_tokens = seq_len - 3
        self.units = corpus.info.sentences

    def _collect(self, start: int, end: int, target: int) -> tuple[list[np.ndarray], int]:
        """Sentences ``start..`` of one document (skipping over-long ones) until ``target`` tokens; next index."""
        c, out, n, j = self.corpus, [], 0, start
        while j < end and n < target:
            length = c.sentence_len(j)
            if length <= self.max_tokens:
                out.append(c.sentence(j))
                n += length
            j += 1
        return out, j

    def _random_segment(self, doc: int, budget: int, rng: random.Random) -> list[np.ndarray]:
        c = self.corpus
        for _ in range(_MAX_TRIES):
            r = rng.randrange(self.units)
            d = c.document_of(r)
            if d == doc:
                continue
            seg, _ = self._collect(r, c.document_sentences(d)[1], budget)
            if seg:
                return seg
        raise CorpusError(f"{c.info.path}: found no usable sentence in another document after {_MAX_TRIES} tries")

    def _pair(self, start: int, rng: random.Random) -> tuple[np.ndarray, np.ndarray, int]:
        c = self.corpus
        for _ in range(_MAX_TRIES):
            doc = c.document_of(start)
            end = c.document_sentences(doc)[1]
            target = self.max_tokens if rng.random() >= SHORT_SEQ_PROB else rng.randint(2, self.max_tokens)
            chunk, after = self._collect(start, end, target)
            if chunk:
                break
            start = rng.randrange(self.units)  # the rest of this document is over-long sentences: elsewhere
        else:
            raise CorpusError(f"{c.info.path}: no sentence fits seq_len {self.seq_len} after {_MAX_TRIES} tries")
        is_random = rng.random() < 0.5
        cut = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
        a, b = chunk[:cut], chunk[cut:]
        if not is_random and not b:
            b, _ = self._collect(after, end, max(1, target - sum(map(len, a))))
            if not b and len(a[0]) >= 2:  # a one-sentence tail of a document: its two halves are A and B
                half = len(a[0]) // 2
                a, b = [a[0][:half]], [a[0][half:]]
            is_random = not b
        if is_random:
            b = self._random_segment(doc, max(1, target - sum(map(len, a))), rng)
        ta, tb = np.concatenate(a), np.concatenate(b)
        la, lb = _truncate(len(ta), len(tb), self.max_tokens)
        return ta[len(ta) - la:], tb[:lb], int(is_random)

    def get(self, step: int, microbatch: int, dp_rank: int = 0) -> tuple[Batch, Batch]:
        bsz, s = self.micro_batch_size, self.seq_len
        ids = torch.full((bsz, s), self.pad, dtype=torch.int64)
        token_type = torch.zeros((bsz, s), dtype=torch.int64)
        attention = torch.zeros((bsz, s), dtype=torch.int64)
        words = torch.zeros((bsz, s), dtype=torch.bool)
        nsp = torch.zeros(bsz, dtype=torch.int64)
        for b, unit in enumerate(self.sample_units(step, microbatch, dp_rank)):
            rng = random.Random(mix_seed(self.seed, self.sample_index(step, microbatch, dp_rank, b)))
            ta, tb, nsp[b] = self._pair(unit, rng)
            la, lb = len(ta), len(tb)
            row = np.concatenate([[self.cls], ta, [self.sep], tb, [self.sep]]).astype(np.int64)
            ids[b, :len(row)] = torch.from_numpy(row)
            token_type[b, la + 2:len(row)] = 1
            attention[b, :len(row)] = 1
            words[b, 1:la + 1] = True
            words[b, la + 2:la + 2 + lb] = True
        gen = address_generator(self.seed, step, microbatch, dp_rank)
        k = (MLM_PROB * words.sum(1)).round().clamp(min=1).long()
        ranks = torch.rand(bsz, s, generator=gen).masked_fill(~words, 2.0).argsort(1).argsort(1)
        chosen = (ranks < k[:, None]) & words
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        action = torch.rand(bsz, s, generator=gen)
        random_ids = torch.randint(self.first_word, self.vocab_size, (bsz, s), generator=gen)
        masked = torch.where(chosen & (action < 0.8), torch.full_like(ids, self.mask), ids)
        masked = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, masked)
        inputs = {"input_ids": masked, "token_type_ids": token_type, "attention_mask": attention}
        return inputs, {"labels": labels, "next_sentence_label": nsp}


def _truncate(la: int, lb: int, limit: int) -> tuple[int, int]:
    """Lengths after trimming the longer segment one token at a time until ``la + lb <= limit``."""
    if la + lb <= limit:
        return la, lb
    short = min(la, lb)
    if short <= limit // 2:
        return (la, limit - la) if la == short else (limit - lb, lb)
    return limit - limit // 2, limit // 2


def check_fit(info: CorpusInfo, seq_len: int) -> str:
    """Raise :class:`CorpusError` if ``info``'s corpus cannot feed sequences of ``seq_len``; else a note.

    BERT skips sentences longer than ``seq_len - 3`` tokens: the note counts them, and more than half
    skipped is an error (the corpus is probably not one sentence per line, or the sequence too short).
    """
    if info.family == "gpt2":
        if info.tokens < seq_len:
            raise CorpusError(f"{info.path}: {info.tokens} tokens, fewer than one sequence of {seq_len}; "
                              "use a bigger corpus or a smaller --seq-len")
        return ""
    if seq_len < 8:
        raise CorpusError(f"BERT pretraining needs --seq-len >= 8, got {seq_len}")
    if info.documents < 2:
        raise CorpusError(f"{info.path}: one document only; next-sentence prediction needs at least two "
                          "(a blank line between documents)")
    limit = seq_len - 3
    long = info.longer_than(limit)
    what = (f"{long} of {info.sentences} sentences of {info.path} are longer than {limit} tokens "
            f"(--seq-len {seq_len} minus [CLS] and two [SEP])")
    if 2 * long > info.sentences:
        raise CorpusError(f"{what}; expected one sentence per line: raise --seq-len or split the lines")
    return f"{what}; BERT samples skip them" if long else ""

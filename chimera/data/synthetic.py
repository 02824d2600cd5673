"""Synthetic BERT-pretraining and GPT-2 datasets (random tokens, correct structure)."""

from __future__ import annotations

import torch

from chimera.data.base import AddressedDataset, Batch

PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 101, 102, 103
FIRST_WORD_ID = 104  # ids below are special / unused in the BERT uncased vocabulary
MLM_PROB = 0.15


class SyntheticBertDataset(AddressedDataset):
    """``[CLS] A [SEP] B [SEP]`` of random word ids, two segments, MLM (15 %, 80/10/10) and NSP labels.

    Exactly ``round(0.15 * (seq_len - 3))`` (at least 1) non-special positions per sample are chosen for
    prediction; of those 80 % become ``[MASK]``, 10 % a random word and 10 % stay. Labels are the
    original ids there and -100 elsewhere. The NSP label is a fair coin (the segments are random).
    """

    def __init__(self, vocab_size: int, seq_len: int, micro_batch_size: int, seed: int = 0) -> None:
        super().__init__(vocab_size, seq_len, micro_batch_size, seed)
        if seq_len < 5:
            raise ValueError(f"SyntheticBertDataset needs seq_len >= 5, got {seq_len}")
        if vocab_size <= FIRST_WORD_ID:
            raise ValueError(f"SyntheticBertDataset needs vocab_size > {FIRST_WORD_ID}, got {vocab_size}")

    def _sample(self, gen: torch.Generator) -> tuple[Batch, Batch]:
        b, s = self.micro_batch_size, self.seq_len
        ids = torch.randint(FIRST_WORD_ID, self.vocab_size, (b, s), generator=gen)
        # segment A has 1..s-4 words: positions 1..len_a, its [SEP] at len_a + 1
        len_a = torch.randint(1, s - 3, (b,), generator=gen)
        pos = torch.arange(s).expand(b, s)
        sep_a = (len_a + 1).unsqueeze(1)
        ids[:, 0] = CLS_ID
        ids[:, -1] = SEP_ID
        ids = torch.where(pos == sep_a, torch.full_like(ids, SEP_ID), ids)
        token_type = (pos > sep_a).long()
        special = (pos == 0) | (pos == s - 1) | (pos == sep_a)

        k = max(1, round(MLM_PROB * (s - 3)))
        scores = torch.rand(b, s, generator=gen).masked_fill(special, 2.0)
        chosen_pos = scores.argsort(dim=1)[:, :k]
        chosen = torch.zeros(b, s, dtype=torch.bool).scatter_(1, chosen_pos, True)
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))

        action = torch.rand(b, s, generator=gen)
        random_ids = torch.randint(FIRST_WORD_ID, self.vocab_size, (b, s), generator=gen)
        masked = ids.clone()
        masked = torch.where(chosen & (action < 0.8), torch.full_like(ids, MASK_ID), masked)
        masked = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, masked)
        nsp = torch.randint(0, 2, (b,), generator=gen)
        inputs = {"input_ids": masked, "token_type_ids": token_type, "attention_mask": torch.ones_like(ids)}
        return inputs, {"labels": labels, "next_sentence_label": nsp}


class SyntheticGPT2Dataset(AddressedDataset):
    """Random token ids; labels are the ids themselves (the model's loss shifts them)."""

    def _sample(self, gen: torch.Generator) -> tuple[Batch, Batch]:
        ids = torch.randint(0, self.vocab_size, (self.micro_batch_size, self.seq_len), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {"labels": ids.clone()}


class SyntheticRegressionDataset(AddressedDataset):
    """Random ``x`` and ``y`` of shape ``[B, hidden]`` (for the delay model)."""

    def __init__(self, hidden: int, micro_batch_size: int, seed: int = 0) -> None:
        super().__init__(0, 1, micro_batch_size, seed)
        self.hidden = hidden

    def _sample(self, gen: torch.Generator) -> tuple[Batch, Batch]:
        shape = (self.micro_batch_size, self.hidden)
        return {"x": torch.randn(shape, generator=gen)}, {"y": torch.randn(shape, generator=gen)}


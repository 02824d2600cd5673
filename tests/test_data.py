"""Synthetic datasets: determinism by address, disjointness, BERT structure and masking statistics."""

from __future__ import annotations

import pytest
import torch

from chimera.data import (
    PipelineDataset,
    SyntheticBertDataset,
    SyntheticGPT2Dataset,
    Units,
    mix_seed,
    text_dataset,
)
from chimera.data.synthetic import CLS_ID, FIRST_WORD_ID, MASK_ID, SEP_ID
from chimera.models import build_model


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cls", [SyntheticBertDataset, SyntheticGPT2Dataset])
def test_deterministic_and_disjoint(cls) -> None:
    d1, d2 = cls(8192, 32, 4, seed=3), cls(8192, 32, 4, seed=3)
    assert isinstance(d1, PipelineDataset)
    (i1, l1), (i2, l2) = d1.get(5, 2, 1), d2.get(5, 2, 1)
    assert _equal(i1, i2) and _equal(l1, l2)
    assert _equal(d1.inputs(5, 2, 1), i1) and _equal(d1.labels(5, 2, 1), l1)
    ids = i1["input_ids"]
    for other in (d1.get(5, 2, 0), d1.get(5, 3, 1), d1.get(6, 2, 1), cls(8192, 32, 4, seed=4).get(5, 2, 1)):
        assert not torch.equal(other[0]["input_ids"], ids)
    assert ids.shape == (4, 32) and ids.dtype == torch.int64
    assert torch.equal(i1["attention_mask"], torch.ones_like(ids))


def test_mix_seed_is_stable() -> None:
    assert mix_seed(1, 2, 3, 4) == mix_seed(1, 2, 3, 4)
    assert len({mix_seed(0, s, m, r) for s in range(4) for m in range(4) for r in range(4)}) == 64
    assert 0 <= mix_seed(2**70, -1) < 2**63


def test_bert_structure() -> None:
    ds = SyntheticBertDataset(8192, 24, 64, seed=0)
    inputs, labels = ds.get(0, 0, 0)
    ids, tt = inputs["input_ids"], inputs["token_type_ids"]
    assert (ids[:, 0] == CLS_ID).all() and (ids[:, -1] == SEP_ID).all()
    assert ((ids == SEP_ID).sum(1) == 2).all()
    # segment 0 = [CLS] A [SEP], segment 1 = B [SEP], both non-empty
    sep_a = (ids == SEP_ID).int().argmax(1)
    assert torch.equal(tt, (torch.arange(24) > sep_a[:, None]).long())
    assert (tt[:, 0] == 0).all() and (tt.sum(1) >= 2).all()
    assert set(labels["next_sentence_label"].tolist()) <= {0, 1}
    mlm = labels["labels"]
    chosen = mlm != -100
    assert not chosen[:, 0].any() and not chosen[:, -1].any()
    assert (mlm[chosen] >= FIRST_WORD_ID).all()


def test_bert_masking_statistics() -> None:
    ds = SyntheticBertDataset(8192, 128, 64, seed=1)
    chosen_total = cand_total = masked = kept = 0
    nsp = []
    for mb in range(64):  # 4096 samples
        inputs, labels = ds.get(0, mb, 0)
        mlm, ids = labels["labels"], inputs["input_ids"]
        chosen = mlm != -100
        chosen_total += int(chosen.sum())
        cand_total += ids.shape[0] * (ids.shape[1] - 3)
        masked += int((ids[chosen] == MASK_ID).sum())
        kept += int((ids[chosen] == mlm[chosen]).sum())
        nsp.append(labels["next_sentence_label"])
    assert abs(chosen_total / cand_total - 0.15) < 0.01
    assert abs(masked / chosen_total - 0.8) < 0.01
    # kept = the 10 % "keep" plus random replacements that drew the same id (negligible)
    assert abs(kept / chosen_total - 0.1) < 0.01
    assert abs(torch.cat(nsp).float().mean().item() - 0.5) < 0.03


def test_gpt2_labels_are_ids() -> None:
    inputs, labels = SyntheticGPT2Dataset(1000, 16, 2, seed=0).get(1, 1, 1)
    assert torch.equal(inputs["input_ids"], labels["labels"])
    assert int(inputs["input_ids"].max()) < 1000


def test_preset_datasets_and_errors() -> None:
    bert = build_model("bert-tiny", seq_len=32).dataset(2, 0)
    assert isinstance(bert, SyntheticBertDataset) and bert.seq_len == 32 and bert.micro_batch_size == 2
    gpt = build_model("gpt2-tiny").dataset(3, 0)
    assert isinstance(gpt, SyntheticGPT2Dataset) and gpt.seq_len == build_model("gpt2-tiny").seq_len
    assert gpt.vocab_size == 8192
    with pytest.raises(ValueError, match="tokenizer"):
        text_dataset("bert", 1000, 64, "sample", 2)
    with pytest.raises(ValueError, match="seq_len"):
        SyntheticBertDataset(8192, 4, 2)
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticBertDataset(100, 16, 2)


def test_units_are_halves_of_micro_batches() -> None:
    """Backward halving trains on units of B/2 samples: unit 2m and 2m+1 are the two halves of micro-batch m."""
    ds = build_model("gpt2-tiny", seq_len=16).dataset(4, 3)
    halves = Units(ds, 2)
    for m in range(3):
        whole = ds.get(1, m, 0)[0]["input_ids"]
        first, second = halves.get(1, 2 * m, 0)[0]["input_ids"], halves.get(1, 2 * m + 1, 0)[0]["input_ids"]
        assert torch.equal(torch.cat([first, second]), whole) and first.shape[0] == 2
    assert Units(ds, 1).get(1, 0, 0)[1]["labels"].shape[0] == 4

"""Fine-tune a pretrained GPT-2 on a text file: ``factory(pretrained_dir, text_file)`` -> ``(chain, data)``.

    from examples.finetune_gpt2 import factory
    chain, data = factory("gpt2-tiny", "chimera/data/sample/enwiki-sample.txt", micro_batches=4)
    chimera.train(chain, data, schedule="chimera", stages=2, micro_batches=4, steps=10, checkpoint_dir="ckpt")

or from the shell: ``python examples/finetune_gpt2.py gpt2-tiny corpus.txt --steps 10 --checkpoint-dir ckpt``.
``pretrained_dir`` is a ``save_pretrained`` directory (its own tokenizer is used when it has one, else the GPT-2
tokenizer shipped under ``chimera/data/sample``); ``text_file`` is plain text in WikiText's layout. With no
arguments (``--chain examples.finetune_gpt2:factory``) they come from ``FINETUNE_PRETRAINED`` and ``FINETUNE_TEXT``.
The chain's own data factory (``chain.data``) gives the same blocks for any micro-batch count and width.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import chimera
from chimera.data.finetune import LanguageModelDataset, language_model_data
from chimera.models.decompose import DecomposedChain
from chimera.models.pretrained import architecture, load_pretrained

SAMPLE_TOKENIZER = Path(chimera.__file__).parent / "data" / "sample" / "enwiki-sample.gpt2"


def factory(pretrained_dir: str | None = None, text_file: str | None = None, *, seq_len: int = 64,
            micro_batch_size: int = 4, micro_batches: int = 4, data_parallel: int = 1, seed: int = 0
            ) -> tuple[DecomposedChain, LanguageModelDataset]:
    """The decomposed GPT-2 of ``pretrained_dir`` (data factory attached) and its dataset of ``text_file`` for
    ``micro_batches`` micro-batches of ``micro_batch_size`` blocks of ``seq_len`` tokens on ``data_parallel`` ranks."""
    pretrained_dir = pretrained_dir or os.environ.get("FINETUNE_PRETRAINED")
    text_file = text_file or os.environ.get("FINETUNE_TEXT")
    if not pretrained_dir or not text_file:
        raise ValueError("factory needs pretrained_dir and text_file (or FINETUNE_PRETRAINED and FINETUNE_TEXT)")
    tokenizer = pretrained_dir if (Path(pretrained_dir) / "tokenizer.json").is_file() else SAMPLE_TOKENIZER
    data = language_model_data(text_file, tokenizer, seq_len, vocab_size=_vocab_size(pretrained_dir))
    chain = load_pretrained(pretrained_dir, data=data, micro_batch_size=micro_batch_size)  # example: data's
    return chain, data(micro_batch_size, seed, micro_batches, data_parallel)


def _vocab_size(pretrained_dir: str) -> int:
    architecture(pretrained_dir)  # a clear error for a directory that is not a saved model
    return int(json.loads((Path(pretrained_dir) / "config.json").read_text())["vocab_size"])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Fine-tune from the shell; prints one line per step and returns the step records."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pretrained_dir")
    p.add_argument("text_file")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--schedule", default="chimera")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoint-dir", default=None)
    a = p.parse_args(argv)
    chain, data = factory(a.pretrained_dir, a.text_file, seq_len=a.seq_len, micro_batch_size=a.micro_batch_size,
                          micro_batches=a.micro_batches)
    records = chimera.train(chain, data, schedule=a.schedule, stages=a.stages, micro_batches=a.micro_batches,
                            steps=a.steps, lr=a.lr, optimizer="adamw", partition="uniform",
                            checkpoint_dir=a.checkpoint_dir)
    for r in records:
        print(f"step {r['step']:3d}  loss {r['loss']:.4f}")
    return records


if __name__ == "__main__":
    main()

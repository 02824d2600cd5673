"""What the ``profile`` and ``plan`` commands share: the model they are about (a preset, or ``--chain``)."""

from __future__ import annotations

import argparse
from typing import Any

from chimera.cli.options import UsageError, add_field
from chimera.compile.model import load_chain
from chimera.config import FIELDS, ConfigError
from chimera.models import PRESETS, build_model


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model`` or ``--chain``, ``--seq-len`` and ``--vocab-shards``: the same flags as training's."""
    add_field(p, "model", default=None, help="preset model: " + ", ".join(sorted(PRESETS)))
    add_field(p, "chain", default=None)
    # training's default, so that a profile or plan taken without --seq-len is of the model training builds
    add_field(p, "seq_len", default=FIELDS["seq_len"].default, help="sequence length of a transformer preset, as "
              "training takes it")
    add_field(p, "vocab_shards", default=1)


def model_of(args: argparse.Namespace) -> Any:
    """The chain the flags name; UsageError when neither or both of ``--model`` and ``--chain`` are given."""
    if (args.model is None) == (args.chain is None):
        raise UsageError("give the model: --model PRESET or --chain pkg.module:factory (one of them)")
    try:
        if args.chain is not None:
            if args.vocab_shards != 1:
                raise UsageError(f"--vocab-shards {args.vocab_shards} splits a GPT-2 preset; split your own model "
                                 "when you make it (decompose(model, vocab_shards=K))")
            return load_chain(args.chain)[0]
        return build_model(args.model, seq_len=args.seq_len, vocab_shards=args.vocab_shards)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None

"""``chimera export``: a trained checkpoint written in the original model's names.

    chimera export ckpt --hf gpt2-tuned                 # a directory transformers' from_pretrained loads
    chimera export ckpt/step-00000100 --torch model.pt  # a plain state_dict (model.state_dict() names)
    chimera export ckpt --torch cnn.pt --chain mypkg.models:chain   # a chain that is not a transformers model
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from chimera.cli.options import UsageError, add_field
from chimera.compile.model import load_chain
from chimera.config import ConfigError
from chimera.export import ExportError, export


def cmd_export(args: argparse.Namespace) -> int:
    """Export; print what was written."""
    if args.hf is None and args.torch is None:
        raise UsageError("chimera export: give --hf DIR and/or --torch FILE")
    try:
        chain = load_chain(args.chain)[0] if args.chain else None
        written = export(args.checkpoint, hf_dir=args.hf, torch_file=args.torch, chain=chain)
    except (ExportError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return 0


def add_parser(sub: Any, parser_class: type) -> None:
    """The ``export`` subcommand."""
    p = sub.add_parser("export", help="write a checkpoint as a transformers directory or a torch state_dict")
    p.add_argument("checkpoint", help="a checkpoint (step directory), or a --checkpoint-dir: its latest")
    p.add_argument("--hf", default=None, metavar="DIR", help="write a transformers save_pretrained directory here")
    p.add_argument("--torch", default=None, metavar="FILE", help="write a torch state_dict here")
    add_field(p, "chain", default=None, help="the chain it was trained from, for a model that is not a transformers "
              "model (the factory, as for chimera train --chain)")
    p.set_defaults(func=cmd_export)

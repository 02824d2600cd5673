"""``chimera data prepare|tokenizer``: a training corpus from a Wikipedia dump.

    chimera data prepare enwiki-latest-pages-articles.xml.bz2 -o data/wikipedia.segmented.txt
    chimera data tokenizer data/wikipedia.segmented.txt --vocab-size 30522
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from chimera.cli.options import deprecated_alias
from chimera.data.corpus import FAMILIES, CorpusError, tokenized_dir
from chimera.data.tokenizer import build_tokenizers
from chimera.data.wiki import PrepareError, prepare_wikipedia


def cmd_prepare(args: argparse.Namespace) -> int:
    try:
        stats = prepare_wikipedia(args.dump, args.output, workers=args.processes, max_docs=args.max_docs,
                                  progress=not args.no_progress)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.output}: {stats.summary()}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    try:
        infos = build_tokenizers(args.corpus, args.family or FAMILIES, vocab_size=args.vocab_size,
                                 min_frequency=args.min_frequency, progress=not args.no_progress)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for family, info in infos.items():
        lengths = ", ".join(f"{info.longer_than(n - 3)} longer than {n - 3}" for n in (64, 128, 512))
        print(f"{family}: {info.vocab_size} tokens in the vocabulary; {info.documents} documents, {info.sentences} "
              f"sentences, {info.tokens} tokens (sentences: {lengths}) in {tokenized_dir(info.path, family)}/")
    return 0


def add_parser(sub: Any, parser_class: type) -> None:
    """The ``data`` subcommand."""
    data = sub.add_parser("data", help="make a training corpus: Wikipedia dump -> sentences -> tokenizers, tokens")
    dsub = data.add_subparsers(dest="action", required=True, parser_class=parser_class)
    prep = dsub.add_parser("prepare", help="Wikipedia XML dump (.xml/.xml.bz2) -> one sentence per line, "
                                           "a blank line between documents")
    prep.add_argument("dump", help="pages-articles dump, .xml or .xml.bz2 (streamed)")
    prep.add_argument("-o", "--output", required=True, help="corpus text file to write (its folder is made)")
    prep.add_argument("--processes", type=int, default=min(8, os.cpu_count() or 1),
                      help="processes cleaning pages (default: up to 8, one per core)")
    deprecated_alias(prep, "--workers", "--processes", "processes", type=int)
    prep.add_argument("--max-docs", type=int, default=None, help="stop after this many documents (default: all)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_prepare)
    tok = dsub.add_parser("tokenizer", help="train WordPiece (BERT) / byte-level BPE (GPT-2) tokenizers on a corpus "
                                            "and tokenize it into memory-mapped files next to it")
    tok.add_argument("corpus", help="segmented corpus (one sentence per line, a blank line between documents)")
    tok.add_argument("--family", nargs="+", choices=FAMILIES, metavar="FAMILY", default=None,
                     help="model families: %(choices)s (default: all)")
    tok.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size of each tokenizer (default: 8192)")
    tok.add_argument("--min-frequency", type=int, default=2, help="minimum count of a merged token (default: 2)")
    tok.add_argument("--no-progress", action="store_true", help="no progress bar")
    tok.set_defaults(func=cmd_tokenizer)

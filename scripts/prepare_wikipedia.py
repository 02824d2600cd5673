#!/usr/bin/env python
"""Wikipedia XML dump → segmented corpus (one sentence per line, a blank line between documents).

    python scripts/prepare_wikipedia.py enwiki-latest-pages-articles.xml.bz2 -o wikipedia.segmented.txt
    chimera data tokenizer wikipedia.segmented.txt        # then: tokenizers and token files next to it

Same as ``chimera data prepare``; see ``--help``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chimera.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["data", "prepare", *sys.argv[1:]]))

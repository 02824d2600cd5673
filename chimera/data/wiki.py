"""Wikipedia XML dump → segmented corpus: one sentence per line, a blank line between documents.

Wiki markup is stripped by gensim's dump reader (``extract_pages``, ``filter_wiki``), sentences are split
by pysbd; both work offline. The dump (``.xml`` or ``.xml.bz2``) is streamed, never loaded whole::

    stats = prepare_wikipedia("enwiki-latest-pages-articles.xml.bz2", "wikipedia.segmented.txt")
"""

from __future__ import annotations

import bz2
import multiprocessing as mp
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import IO, Any
from xml.etree.ElementTree import ParseError

from tqdm import tqdm

BATCH_PAGES = 64  # pages handed to the worker pool at a time: bounds memory, keeps workers busy
_HEADING = re.compile(r"^=+.*=+$")
_BOLD_ITALIC = re.compile(r"'{2,}")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:])")
_SPACES = re.compile(r"\s+")
_MARKUP = ("[[", "]]", "{{", "}}", "<ref", "</ref", "|")
_MIN_PARAGRAPH_WORDS = 4
_FILE_PREFIXES = ("File:", "Image:", "Category:", "thumb")


class PrepareError(ValueError):
    """The input is not a readable Wikipedia dump; the message says why."""


@dataclass
class PrepareStats:
    """Counts reported at the end of a run."""

    documents: int = 0
    sentences: int = 0
    pages: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def skipped_pages(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        why = ", ".join(f"{n} {k}" for k, n in sorted(self.skipped.items())) or "none"
        return (f"{self.documents} documents, {self.sentences} sentences; {self.skipped_pages} of {self.pages} "
                f"pages skipped ({why})")


class _Progress:
    """A binary file wrapper that advances a tqdm bar by the bytes read (of the compressed file)."""

    def __init__(self, f: IO[bytes], bar: tqdm) -> None:
        self.f, self.bar = f, bar

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.bar.update(len(data))
        return data


_segmenter: Any = None


def _segment(text: str) -> list[str]:
    global _segmenter
    if _segmenter is None:
        import pysbd

        _segmenter = pysbd.Segmenter(language="en", clean=False)
    return _segmenter.segment(text)


def clean_paragraphs(wikitext: str) -> list[str]:
    """Plain-text paragraphs of one article: markup, headings, lists, tables and galleries removed."""
    from gensim.corpora.wikicorpus import filter_wiki

    out = []
    for line in filter_wiki(wikitext).splitlines():
        line = line.strip()
        if (not line or _HEADING.match(line) or line[0] in "*#:;!|" or line.startswith(_FILE_PREFIXES)
                or any(m in line for m in _MARKUP)):
            continue  # headings, lists, tables, galleries and leftover markup are not prose
        line = _BOLD_ITALIC.sub("", line)
        line = _EMPTY_PARENS.sub("", line)
        line = _SPACE_BEFORE_PUNCT.sub(r"\1", _SPACES.sub(" ", line)).strip()
        if len(line.split()) >= _MIN_PARAGRAPH_WORDS:
            out.append(line)
    return out


def page_sentences(item: tuple[str, str]) -> tuple[str, list[str]]:
    """``(title, wikitext)`` → ``(skip reason or "", sentences)``."""
    from gensim.corpora.wikicorpus import IGNORED_NAMESPACES

    title, text = item
    if not text.strip():
        return "non-article", []
    if text.lstrip()[:9].upper() == "#REDIRECT":
        return "redirect", []
    if title.split(":", 1)[0] in IGNORED_NAMESPACES:
        return "non-article", []
    sentences = [_SPACES.sub(" ", s).strip() for p in clean_paragraphs(text) for s in _segment(p)]
    sentences = [s for s in sentences if s]
    return ("empty", []) if not sentences else ("", sentences)


def _open_dump(path: Path) -> IO[bytes]:
    if not path.is_file():
        raise PrepareError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise PrepareError(f"{path}: empty file (expected a Wikipedia XML dump, .xml or .xml.bz2)")
    with open(path, "rb") as f:
        head = f.read(4)
    return open(path, "rb") if head[:3] != b"BZh" else bz2.BZ2File(path, "rb")  # noqa: SIM115


def _pages(f: Any) -> Iterator[tuple[str, str]]:
    from gensim.corpora.wikicorpus import extract_pages

    for title, text, _ in extract_pages(f, filter_namespaces=("0",)):
        yield title or "", text or ""


def prepare_wikipedia(dump: str | Path, out: str | Path, *, workers: int = 1, max_docs: int | None = None,
                      progress: bool = True) -> PrepareStats:
    """Write the segmented corpus of ``dump`` to ``out``; return the counts.

    ``workers`` > 1 cleans and splits pages in that many processes (order is kept). ``max_docs`` stops
    after that many documents (for small sample corpora).
    """
    dump, out = Path(dump), Path(out)
    raw = _open_dump(dump)
    try:  # a fresh clone has no data/ yet
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raw.close()
        why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or e
        raise PrepareError(f"-o {out}: cannot create its folder {out.parent} ({why}); pick another output path"
                           ) from None
    stats = PrepareStats()
    pool = mp.get_context("spawn").Pool(workers) if workers > 1 else None
    bar = tqdm(total=dump.stat().st_size, unit="B", unit_scale=True, desc=f"prepare {dump.name}",
               disable=not progress, dynamic_ncols=True)
    tmp = out.with_name(out.name + ".partial")
    try:
        f = _Progress(raw, bar)
        pages = _pages(f)
        with open(tmp, "w", encoding="utf-8") as w:
            while max_docs is None or stats.documents < max_docs:
                try:
                    batch = list(islice(pages, BATCH_PAGES))
                except (ParseError, OSError, EOFError, ValueError) as e:
                    raise PrepareError(f"{dump}: not a Wikipedia XML dump ({type(e).__name__}: {e})") from None
                if not batch:
                    break
                results = pool.map(page_sentences, batch) if pool else [page_sentences(p) for p in batch]
                for reason, sentences in results:
                    if max_docs is not None and stats.documents >= max_docs:
                        break
                    stats.pages += 1
                    if reason:
                        stats.skipped[reason] = stats.skipped.get(reason, 0) + 1
                        continue
                    w.write(("\n" if stats.documents else "") + "\n".join(sentences) + "\n")
                    stats.documents += 1
                    stats.sentences += len(sentences)
                bar.set_postfix(docs=stats.documents, sentences=stats.sentences)
        if stats.documents == 0:
            raise PrepareError(f"{dump}: no article with text among {stats.pages} pages ({stats.summary()})")
        tmp.replace(out)
    finally:
        bar.close()
        raw.close()
        if pool:
            pool.terminate()
        tmp.unlink(missing_ok=True)
    return stats

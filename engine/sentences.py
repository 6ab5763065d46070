"""Where sentences end, for text the engine writes (the sentence-complete stop) and for the
summariser's chunking (pipeline.chunking): one definition, so both agree on what a sentence is.

A sentence ends at . ! ? or … (repeated or not, then any closing quotes and brackets) followed by
whitespace or the end of the text, and at the CJK full stops 。！？ (Chinese and Japanese put no
space after them). Not sentence ends: a period after a known abbreviation ("e.g.", "Dr."), after a
single letter (an initial: "J. Smith"), and a list number at the start of a line ("1. Install").
"""
from __future__ import annotations

import re
from collections.abc import Iterator

_CLOSERS = "\"'\u201d\u2019)\\]\u300d\u300f\uff09"  # " ' ” ’ ) ] 」 』 ）
_LATIN_END = re.compile(rf"[.!?\u2026]+[{_CLOSERS}]*(?=\s|$)")
_CJK_END = re.compile(rf"[\u3002\uff01\uff1f]+[{_CLOSERS}]*")
# Words after which a period rarely ends a sentence (lower-cased, without the final period).
ABBREVIATIONS = frozenset(
    "e.g i.e cf vs viz al approx dr mr mrs ms prof sr jr st mt fig figs eq eqs sec vol pp ch dept".split())
_WORD_BEFORE = re.compile(r"([\w.]+)\.$")
_LIST_NUMBER = re.compile(r"(?:^|\n)[ \t]*\d{1,3}\.$")
_FENCE = re.compile(r"^[ \t]{0,3}(?:```|~~~)", re.M)


def sentence_ends(text: str, start: int = 0) -> Iterator[int]:
    """Offsets right after each sentence end at or after `start` (after its closing quotes and
    brackets, before the whitespace that follows), in order."""
    hits = [m.end() for m in _LATIN_END.finditer(text, start) if not _is_false_end(text, m.start(), m.end())]
    hits += [m.end() for m in _CJK_END.finditer(text, start)]
    yield from sorted(set(hits))


def _is_false_end(text: str, mark: int, end: int) -> bool:
    """A single period that follows an abbreviation, an initial or a list number."""
    if text[mark:end].rstrip(_CLOSERS) != ".":
        return False
    head = text[max(0, mark - 24):mark + 1]
    if _LIST_NUMBER.search(head):
        return True
    word = _WORD_BEFORE.search(head)
    if word is None:
        return False
    w = word.group(1).lower()
    return (len(w) == 1 and w.isalpha()) or w in ABBREVIATIONS


def complete_end(text: str) -> int:
    """The length of the longest prefix of `text` that ends a sentence or a line (a list item, a
    heading) outside an unclosed code block, trailing whitespace excluded; 0 when there is none."""
    best = 0
    for best in sentence_ends(text):
        pass
    line = text.rfind("\n")
    if line > best:
        best = len(text[:line].rstrip())
    fence = open_fence_start(text[:best])
    if fence is not None:  # a line of a code block that never closes is no place to end
        best = complete_end(text[:fence])
    return best


def open_fence_start(text: str) -> int | None:
    """Where the last code fence (``` or ~~~ opening a line) that is not closed in `text` starts."""
    fences = [m.start() for m in _FENCE.finditer(text)]
    return fences[-1] if len(fences) % 2 else None


def trim_to_complete(text: str) -> str:
    """`text` cut after its last complete sentence or line; unchanged when it has none (a text
    that is all one unfinished sentence keeps what it has rather than becoming empty)."""
    end = complete_end(text)
    return text[:end] if end > 0 else text

"""Split a document into chunks that fit a worker's KV budget, measured in the model's own tokens,
following the document's structure.

A chunk is sent to the model wrapped in the map prompt, and the model then writes up to
``max_summary_tokens`` more tokens into the same KV cache. So what has to fit is

    tokens(rendered map prompt around the chunk) + max_summary_tokens <= kv_capacity

The caller states that through ``measure`` (text -> tokens it will cost once wrapped) and
``limit`` (the most ``measure`` may return). Without ``measure`` the bare chunk is counted with
``tokenizer.encode``.

Boundaries, in order of preference: section starts (a Markdown heading - ``#`` or underlined - or
a plain-text heading line: ALL CAPS, "3. Title", Title Case, standing alone), paragraph ends (a
blank line; a fenced code block's start and end), sentence ends (engine.sentences: ``.!?…`` then
whitespace, CJK ``。！？``; list items count as sentences), and only when one sentence is longer
than the chunk, word ends (whitespace, CJK ``，、；``) and, last, a cut inside a word (a URL, a
base64 blob). A chunk ends at the strongest boundary that keeps at least ``min_fill`` of the text
that would fit, else at the furthest sentence end. Inside a fenced code block (```` ``` ```` or
``~~~``) the only boundaries are its line ends, used only when the block alone is over the chunk.
A heading is never left as the last line of a chunk.

Consecutive chunks overlap by whole sentences of the previous chunk's tail (at most
``overlap_tokens``; none when no whole sentence fits, and none across a section start).
Each chunk carries its section path: the titles of the headings it sits under.

Compared with LangChain's RecursiveCharacterTextSplitter (separators tried in order, pieces merged
up to the size, overlap from whatever pieces end the previous chunk - words when a sentence did
not fit; its Markdown separators split at headings and fences but the headings travel with no
chunk) and LlamaIndex's SentenceSplitter (paragraphs, then sentences, then clause punctuation,
then words, overlap of trailing pieces in tokens; section paths only from its separate Markdown
parser): here the sizes are the model's tokens of the wrapped prompt, headings are the strongest
cut, code blocks stay whole, and the overlap is never a partial sentence.

Everything is a pure function of (text, tokenizer, limits): the same input always gives the same
chunks, which keeps the map jobs' prompts identical across runs (and cache-friendly).
"""
from __future__ import annotations

import bisect
import re
import unicodedata
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from engine.sentences import sentence_ends
from pipeline.structure import Heading, code_blocks, inside_block, outline, section_path_at, section_paths


class TokenizerLike(Protocol):
    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ChunkingError(ValueError):
    """The budget cannot hold even the smallest useful piece of text."""


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int  # char offsets into the original text; text == original[start:end].strip()
    end: int
    text: str
    tokens: int  # what `measure` said for this chunk (prompt-wrapped tokens when measure wraps)
    section_path: tuple[str, ...] = ()  # titles of the headings the chunk's start sits under, outermost first


# Boundary strengths. A boundary is a char offset where a chunk may end (and the next begin).
WORD, SENTENCE, PARAGRAPH, SECTION = 1, 2, 3, 4

_PARAGRAPH_RE = re.compile(r"\n[ \t]*\n\s*")
_WORD_RE = re.compile(r"\s+")
# Clause marks of scripts written without spaces: word-level cuts for a CJK sentence over the chunk.
_CJK_CLAUSE_RE = re.compile(r"[\uff0c\u3001\uff1b\uff1a]")
# List items (and headings) start a new block even without a blank line before them.
_BLOCK_START_RE = re.compile(r"\n(?=[ \t]*(?:#{1,6}\s|[-*+]\s|\d+[.)]\s))")


def boundaries(text: str, blocks: list[tuple[int, int]] | None = None,
               headings: list[Heading] | None = None) -> tuple[list[int], list[int]]:
    """Sorted candidate cut offsets and their strengths.

    An offset is the position right after the whitespace that follows the boundary, so a chunk
    text[a:b] ends with whatever whitespace closed it and the next starts on a word.
    """
    blocks = code_blocks(text) if blocks is None else blocks
    headings = outline(text, blocks) if headings is None else headings
    strength: dict[int, int] = {}

    def mark(pos: int, level: int) -> None:
        if 0 < pos < len(text) and strength.get(pos, 0) < level and not inside_block(blocks, pos):
            strength[pos] = level

    for m in _WORD_RE.finditer(text):
        mark(m.end(), WORD)
    for m in _CJK_CLAUSE_RE.finditer(text):
        mark(m.end(), WORD)
    for end in sentence_ends(text):
        ws = _WORD_RE.match(text, end)
        mark(ws.end() if ws else end, SENTENCE)
    for m in _BLOCK_START_RE.finditer(text):
        mark(m.end(), SENTENCE)
    for m in _PARAGRAPH_RE.finditer(text):
        mark(m.end(), PARAGRAPH)
    for a, b in blocks:
        # a block is cut at its own line ends only when it alone is over the chunk
        nl = text.find("\n", a)
        while 0 <= nl < b - 1:
            strength[nl + 1] = WORD
            nl = text.find("\n", nl + 1)
        ws = _WORD_RE.match(text, b)
        mark(a, PARAGRAPH)
        mark(ws.end() if ws else b, PARAGRAPH)
    for h in headings:
        if 0 < h.start < len(text):
            strength[h.start] = SECTION
    positions = sorted(strength)
    for h in headings:  # never end a chunk with a heading (nor between a heading and its subheading)
        for pos in positions[bisect.bisect_right(positions, h.start):bisect.bisect_right(positions, h.body)]:
            strength.pop(pos, None)
    positions = sorted(strength)
    return positions, [strength[p] for p in positions]


def chunk_text(
    text: str,
    tokenizer: TokenizerLike | None,
    limit: int,
    *,
    overlap_tokens: int = 32,
    measure: Callable[[str], int] | None = None,
    min_fill: float = 0.5,
) -> list[Chunk]:
    """Split ``text`` into chunks whose ``measure`` is at most ``limit``.

    overlap_tokens: at most this much of the previous chunk's tail (in bare tokens, whole sentences)
        starts the next chunk. Kept below a quarter of the limit so chunks always make progress.
    min_fill: a chunk may end at a stronger boundary (section over paragraph over sentence) only if
        that keeps at least this share of the text that would fit; otherwise a weaker boundary
        further on is used. Stops a paragraph break early in the window from making tiny chunks.
    """
    if limit < 1:
        raise ChunkingError(f"no room for any text: the budget left for a chunk is {limit} tokens")
    if measure is None:
        if tokenizer is None:
            raise TypeError("chunk_text needs a tokenizer or a measure function")

        def measure(s: str) -> int:
            return len(tokenizer.encode(s))

    def count(s: str) -> int:
        return len(tokenizer.encode(s)) if tokenizer is not None else measure(s)

    if not text.strip():
        return []

    cache: dict[tuple[int, int], int] = {}

    def cost(a: int, b: int) -> int:
        key = (a, b)
        if key not in cache:
            cache[key] = measure(text[a:b].strip())
        return cache[key]

    blocks = code_blocks(text)
    headings = outline(text, blocks)
    paths = section_paths(headings)
    positions, levels = boundaries(text, blocks, headings)
    strength = dict(zip(positions, levels))
    n = len(text)
    positions.append(n)
    levels.append(PARAGRAPH)
    # Start at the first non-space character.
    start = len(text) - len(text.lstrip())
    chunks: list[Chunk] = []
    overlap_cap = max(0, min(overlap_tokens, limit // 4))

    prev_end = start
    while True:
        # (The end of the text is the last candidate: "the rest fits" is found by the same search.)
        end = _furthest_fit(text, start, positions, levels, cost, limit, min_fill, prev_end)
        if end < n and end <= prev_end:
            # The overlap left no room to move past the previous chunk (a huge word follows):
            # give up the overlap for this chunk.
            start = prev_end
            while text[start].isspace():
                start += 1
            end = _furthest_fit(text, start, positions, levels, cost, limit, min_fill, start)
        chunk_str = text[start:end].strip()
        chunks.append(Chunk(len(chunks), start, end, chunk_str, cost(start, end),
                            section_path_at(headings, paths, start)))
        if end >= n:
            break
        # No overlap into a new section: its chunk starts at its heading.
        cap = 0 if strength.get(end) == SECTION else overlap_cap
        nxt = _overlap_start(text, start, end, positions, levels, count, cap)
        # Skip whitespace so the next chunk starts on a character.
        while nxt < n and text[nxt].isspace():
            nxt += 1
        if nxt >= n:
            break
        start, prev_end = nxt, end
    return chunks


def _furthest_fit(text, start, positions, levels, cost, limit, min_fill, min_end) -> int:
    """The end offset for a chunk beginning at ``start``: the text's end when the rest fits."""
    lo_idx = bisect.bisect_right(positions, start)
    cand = positions[lo_idx:]
    # cost(start, p) grows with p (more text, more tokens): find the last candidate that fits.
    # Probe exponentially first so a chunk early in a long document does not tokenize the rest.
    best, bad, probe, step = -1, len(cand), 0, 1
    while probe < len(cand):
        if cost(start, cand[probe]) <= limit:
            best = probe
            probe += step
            step *= 2
        else:
            bad = probe
            break
    lo, hi = best + 1, min(bad, len(cand)) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if cost(start, cand[mid]) <= limit:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best < 0:
        return _hard_cut(text, start, cand[0] if cand else len(text), cost, limit)
    furthest = cand[best]
    if furthest == len(text):
        return furthest
    # Prefer the strongest boundary that still keeps min_fill of the text that fits.
    floor = max(start + (furthest - start) * min_fill, min_end + 1)
    for level in (SECTION, PARAGRAPH, SENTENCE):
        for i in range(best, -1, -1):
            if cand[i] < floor:
                break
            if levels[lo_idx + i] >= level and cost(start, cand[i]) <= limit:
                return cand[i]
    # Else the furthest sentence end, however short the chunk: a word-level cut only for a
    # sentence (or code block) longer than the chunk.
    for i in range(best, -1, -1):
        if cand[i] <= min_end:
            break
        if levels[lo_idx + i] >= SENTENCE and cost(start, cand[i]) <= limit:
            return cand[i]
    return furthest


def _hard_cut(text, start, stop, cost, limit) -> int:
    """No boundary fits: cut inside the run of text before ``stop`` at the furthest fitting char."""
    lo, hi, best = start + 1, stop, -1
    while lo <= hi:
        mid = (lo + hi) // 2
        if cost(start, mid) <= limit:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best < 0:
        raise ChunkingError(
            f"not even one character fits: the chunk budget is {limit} tokens and "
            f"{text[start:start + 1]!r} costs {cost(start, start + 1)} once wrapped in the prompt"
        )
    # Keep a base character together with the combining marks that follow it.
    while best > start + 1 and best < len(text) and unicodedata.combining(text[best]):
        best -= 1
    return best


def _overlap_start(text, start, end, positions, levels, count, overlap_cap) -> int:
    """Where the next chunk starts: a little before ``end`` (the overlap), but after ``start``."""
    if overlap_cap <= 0:
        return end
    # Candidates in (start, end): the earliest one whose tail text[p:end] fits overlap_cap tokens.
    lo_idx = bisect.bisect_right(positions, start)
    hi_idx = bisect.bisect_left(positions, end)
    window = positions[lo_idx:hi_idx]
    window_levels = levels[lo_idx:hi_idx]
    # Not back over a section start: the overlap stays in the section the next chunk continues.
    sections = [i for i, level in enumerate(window_levels) if level >= SECTION]
    if sections:
        window, window_levels = window[sections[-1]:], window_levels[sections[-1]:]
    if not window:
        return end
    # Tail cost shrinks as p grows; binary search the first p with count(text[p:end]) <= cap.
    lo, hi, first = 0, len(window) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if count(text[window[mid]:end].strip()) <= overlap_cap:
            first, hi = mid, mid - 1
        else:
            lo = mid + 1
    if first is None:
        return end
    # Whole sentences only: the earliest sentence (or stronger) start whose tail fits; none fits,
    # no overlap - a partial sentence would start the next chunk mid-thought.
    for i in range(first, len(window)):
        if window_levels[i] >= SENTENCE:
            return window[i]
    return end

"""A document's structure for chunking and prompts: fenced code blocks and headings.

Headings: Markdown ATX (``## Title``) and underlined ones (Setext ``===``/``---``, reStructuredText
``~~~`` and friends), and plain-text heading lines that stand alone between blank lines - ALL CAPS
(level 1; also a title block's first line: "GNU GENERAL PUBLIC LICENSE" over "Version 3"), Title Case
or numbered ("3. Definitions": level 2, "3.1 Scope": level 3; not the items of a loose numbered list).
Nothing inside a code block is a heading ("# install" in a shell block is a comment).
"""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Heading:
    start: int  # offset of the heading's first line
    body: int  # offset of the first text after it (after an underline and blank lines)
    level: int  # 1 = outermost
    title: str


_FENCE_RE = re.compile(r"^[ \t]{0,3}(`{3,}|~{3,})", re.M)
_ATX_RE = re.compile(r"^[ \t]{0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_UNDERLINE_RE = re.compile(r"^[ \t]{0,3}([=\-~^*+#])\1{2,}[ \t]*$")
_NUMBERED_RE = re.compile(r"^(\d{1,3}(?:\.\d{1,3})*)[.)]?[ \t]+(\S.*)$")
_SMALL_WORDS = frozenset("a an and as at by for from in into of on or the to with".split())
MAX_HEADING_CHARS = 80


def code_blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) of each fenced code block: from its opening fence line to the end of its
    closing fence line. A fence never closed is not taken as one (a stray ``` in plain text would
    otherwise swallow the rest of the document)."""
    blocks: list[tuple[int, int]] = []
    opening: re.Match[str] | None = None
    for m in _FENCE_RE.finditer(text):
        if opening is None:
            opening = m
        elif m.group(1)[0] == opening.group(1)[0] and len(m.group(1)) >= len(opening.group(1)) \
                and not text[m.end():_line_end(text, m.end())].strip():
            blocks.append((opening.start(), _line_end(text, m.end())))
            opening = None
    return blocks


def _line_end(text: str, pos: int) -> int:
    nl = text.find("\n", pos)
    return len(text) if nl < 0 else nl


def _block_at(blocks: list[tuple[int, int]], pos: int) -> tuple[int, int] | None:
    """The code block whose span [start, end] holds offset pos."""
    i = bisect.bisect_right(blocks, (pos, math.inf)) - 1
    return blocks[i] if i >= 0 and blocks[i][0] <= pos <= blocks[i][1] else None


def inside_block(blocks: list[tuple[int, int]], pos: int) -> bool:
    """Whether offset pos is strictly inside a code block (its start and its end excluded)."""
    block = _block_at(blocks, pos)
    return block is not None and block[0] < pos < block[1]


def _in_block(blocks: list[tuple[int, int]], pos: int) -> bool:
    return _block_at(blocks, pos) is not None


def outline(text: str, blocks: list[tuple[int, int]] | None = None) -> list[Heading]:
    """The document's headings in order: Markdown ATX (``## Title``) and underlined ones (Setext
    ``===``/``---``, reStructuredText ``~~~`` and friends), and plain-text heading lines that stand
    alone between blank lines: ALL CAPS (level 1), Title Case or numbered ("3. Definitions",
    level 2, "3.1 Scope" level 3). Nothing inside code blocks."""
    blocks = code_blocks(text) if blocks is None else blocks
    lines = text.split("\n")
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    headings: list[Heading] = []
    underline_levels: dict[str, int] = {"=": 1, "-": 2}

    def blank(i: int) -> bool:
        return i < 0 or i >= len(lines) or not lines[i].strip()

    def body_after(i: int) -> int:
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        return starts[j] if j < len(lines) else len(text)

    skip_to = -1
    for i, line in enumerate(lines):
        if i <= skip_to or _in_block(blocks, starts[i]):
            continue
        stripped = line.strip()
        if not stripped:
            continue
        atx = _ATX_RE.match(line)
        if atx:
            headings.append(Heading(starts[i], body_after(i), len(atx.group(1)), atx.group(2).strip()))
            continue
        if len(stripped) > MAX_HEADING_CHARS or not any(c.isalpha() for c in stripped):
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        under = _UNDERLINE_RE.match(nxt)
        if under and blank(i - 1) and not (line.lstrip()[:1] in "-*+•" and line.lstrip()[1:2].isspace()):
            char = under.group(1)
            level = underline_levels.setdefault(char, max(underline_levels.values()) + 1)
            headings.append(Heading(starts[i], body_after(i + 1), level, stripped))
            skip_to = i + 1
            continue
        if blank(i - 1) and blank(i + 1):
            level = _plain_heading_level(stripped, lines, i)
            if level:
                headings.append(Heading(starts[i], body_after(i), level, stripped.rstrip(".:")))
        elif blank(i - 1) and _is_caps_title(stripped):  # a title block: "GNU GENERAL PUBLIC LICENSE\n Version 3"
            headings.append(Heading(starts[i], body_after(i), 1, stripped))
    return headings


def _plain_heading_level(line: str, lines: list[str], i: int) -> int:
    """The level of a plain-text heading line standing alone, 0 when it does not look like one."""
    if line[-1] in ",;" or (line[0] in "-*+•" and line[1:2].isspace()):
        return 0
    words = line.split()
    if len(words) > 10:
        return 0
    if _is_caps_title(line):
        return 1
    numbered = _NUMBERED_RE.match(line)
    if numbered:
        # "1. Install it" in a loose list is an item, not a heading: its neighbours are items too
        def neighbour(step: int) -> str:
            j = i + step
            while 0 <= j < len(lines) and not lines[j].strip():
                j += step
            return lines[j].strip() if 0 <= j < len(lines) else ""

        title = numbered.group(2)
        if (len(words) <= 8 and title[:1].isupper() and not _NUMBERED_RE.match(neighbour(1))
                and not _NUMBERED_RE.match(neighbour(-1))):
            return 2 + numbered.group(1).count(".")
        return 0
    if line[-1] in ".!?:" or len(words) > 8:
        return 0
    if all(w[:1].isupper() or not w[:1].isalpha() or w.lower() in _SMALL_WORDS for w in words) \
            and words[0][:1].isupper():
        return 2
    return 0


def _is_caps_title(line: str) -> bool:
    letters = [c for c in line if c.isalpha()]
    return (len(letters) >= 3 and all(c.isupper() for c in letters) and len(line.split()) <= 10
            and line[-1] not in ".,;:")


def section_paths(headings: list[Heading]) -> list[tuple[str, ...]]:
    """The path (outer titles, then its own) of each heading."""
    stack: list[Heading] = []
    paths = []
    for h in headings:
        while stack and stack[-1].level >= h.level:
            stack.pop()
        stack.append(h)
        paths.append(tuple(x.title for x in stack))
    return paths


def section_path_at(headings: list[Heading], paths: list[tuple[str, ...]], pos: int) -> tuple[str, ...]:
    """The section path in force at offset pos (a heading starting at pos counts)."""
    i = bisect.bisect_right([h.start for h in headings], pos) - 1
    return paths[i] if i >= 0 else ()

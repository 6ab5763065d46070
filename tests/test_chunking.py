"""Token-budgeted chunking: pure logic with a stand-in tokenizer, then the real SmolLM2 tokenizer."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.chunking import PARAGRAPH, SECTION, SENTENCE, ChunkingError, boundaries, chunk_text

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LONG_DOC = (EXAMPLES / "design-tiered-storage.md").read_text(encoding="utf-8")
MEDIUM_DOC = (EXAMPLES / "history-of-the-telegraph.md").read_text(encoding="utf-8")
SHORT_DOC = (EXAMPLES / "team-sync-notes.md").read_text(encoding="utf-8")


class WordPieceTokenizer:
    """Stand-in with BPE-like behaviour: a leading space joins the word, long words split in 4s."""

    _piece = re.compile(r" ?[A-Za-z]+| ?\d+| ?[^\sA-Za-z\d]|\s+")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inv: list[str] = []

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.inv)
            self.inv.append(piece)
        return self.vocab[piece]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = []
        for m in self._piece.finditer(text):
            word = m.group()
            for i in range(0, len(word), 4):
                ids.append(self._id(word[i:i + 4]))
        return ids

    def decode(self, ids) -> str:
        return "".join(self.inv[i] for i in ids)


@pytest.fixture(scope="module")
def tok():
    return WordPieceTokenizer()


def check_chunks(text, chunks, limit, measure):
    """The invariants every chunking must keep."""
    assert chunks, "non-empty text gives at least one chunk"
    # Every chunk fits.
    for c in chunks:
        assert c.text, c
        assert c.tokens == measure(c.text) <= limit, (c.index, c.tokens, limit)
        assert c.text == text[c.start:c.end].strip()
    # Cover the whole text, in order, each chunk making progress.
    assert text[: chunks[0].start].strip() == ""
    assert text[chunks[-1].end:].strip() == ""
    for a, b in zip(chunks, chunks[1:]):
        assert a.start < b.start <= a.end < b.end, (a.index, a.start, a.end, b.start, b.end)
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_tiny_text_is_one_chunk(tok):
    chunks = chunk_text("Just one short line.", tok, 100)
    assert len(chunks) == 1
    assert chunks[0].text == "Just one short line."
    assert chunk_text(SHORT_DOC, tok, 10_000)[0].text == SHORT_DOC.strip()


def test_empty_text_gives_no_chunks(tok):
    assert chunk_text("", tok, 100) == []
    assert chunk_text(" \n\n\t ", tok, 100) == []


@pytest.mark.parametrize("limit", [60, 150, 400, 1000])
def test_long_document_invariants(tok, limit):
    measure = lambda s: len(tok.encode(s))  # noqa: E731
    chunks = chunk_text(LONG_DOC, tok, limit)
    check_chunks(LONG_DOC, chunks, limit, measure)
    assert len(chunks) >= len(tok.encode(LONG_DOC)) // limit


def test_breaks_at_paragraphs_then_sentences(tok):
    positions, levels = boundaries(LONG_DOC)
    strength = dict(zip(positions, levels))
    chunks = chunk_text(LONG_DOC, tok, 400)
    assert len(chunks) > 5
    ends = [strength.get(c.end, 0) for c in chunks[:-1]]
    # With 400 tokens of room there is always a sentence end in the second half of the window.
    assert all(level >= SENTENCE for level in ends), ends
    # ... and most of the time a paragraph end or a section start.
    assert sum(level >= PARAGRAPH for level in ends) >= len(ends) // 2, ends
    assert SECTION in ends  # the design doc's headings are taken
    for c in chunks[:-1]:
        assert re.search(r"[.!?:)\w]$", c.text), c.text[-40:]


def check_overlaps(text, chunks, cap, count):
    """Overlaps are whole sentences of at most cap tokens, none after a section start; returns how
    many pairs overlap."""
    strength = dict(zip(*boundaries(text)))
    overlapping = 0
    for a, b in zip(chunks, chunks[1:]):
        shared = text[b.start:a.end].strip()
        if strength.get(a.end) == SECTION:
            assert not shared, "no overlap into a new section"
        if shared:
            overlapping += 1
            assert count(shared) <= cap
            assert a.text.endswith(shared) and b.text.startswith(shared)
            assert strength.get(b.start, 0) >= SENTENCE, f"overlap starts mid-sentence: {shared[:50]!r}"
    return overlapping


def test_overlap_whole_sentences_and_bounded(tok):
    chunks = chunk_text(LONG_DOC, tok, 300, overlap_tokens=40)
    assert len(chunks) > 3
    overlapping = check_overlaps(LONG_DOC, chunks, 40, lambda s: len(tok.encode(s)))
    strength = dict(zip(*boundaries(LONG_DOC)))
    within_sections = sum(strength.get(c.end) != SECTION for c in chunks[:-1])
    assert overlapping >= within_sections // 3, (overlapping, within_sections)
    # No overlap asked, none given: chunks then tile the text exactly.
    tiled = chunk_text(LONG_DOC, tok, 300, overlap_tokens=0)
    for a, b in zip(tiled, tiled[1:]):
        assert LONG_DOC[a.end:b.start].strip() == ""


def test_deterministic(tok):
    a = chunk_text(MEDIUM_DOC, tok, 200)
    b = chunk_text(MEDIUM_DOC, WordPieceTokenizer(), 200)
    assert a == b


def test_measure_counts_the_wrapped_prompt(tok):
    prefix = "Summarise the following text in two sentences. " * 5
    measure = lambda s: len(tok.encode(prefix + s)) + 30  # noqa: E731  (+30: reply room)
    limit = 256
    chunks = chunk_text(MEDIUM_DOC, tok, limit, measure=measure)
    check_chunks(MEDIUM_DOC, chunks, limit, measure)
    assert len(chunks) > 1


def test_no_room_raises(tok):
    measure = lambda s: 100 + len(tok.encode(s))  # noqa: E731
    with pytest.raises(ChunkingError, match="budget"):
        chunk_text("Some text here.", tok, 50, measure=measure)
    with pytest.raises(ChunkingError):
        chunk_text("Some text here.", tok, 0)


def test_word_longer_than_budget_is_cut_inside(tok):
    blob = "x" * 400
    text = f"Start of text. {blob} end of text."
    measure = lambda s: len(tok.encode(s))  # noqa: E731
    chunks = chunk_text(text, tok, 20)
    check_chunks(text, chunks, 20, measure)
    assert "".join(c.text for c in chunks).count("x") >= 400


def test_sentence_boundaries_without_paragraphs(tok):
    text = " ".join(f"Sentence number {i} says something short." for i in range(200))
    positions, levels = boundaries(text)
    strength = dict(zip(positions, levels))
    chunks = chunk_text(text, tok, 50)
    check_chunks(text, chunks, 50, lambda s: len(tok.encode(s)))
    assert all(strength.get(c.end) == SENTENCE for c in chunks[:-1])
    assert all(c.text.endswith(".") for c in chunks)


_word = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDE0123456789é", min_size=1, max_size=12)
_sentence = st.lists(_word, min_size=1, max_size=15).map(lambda ws: " ".join(ws) + ".")
_paragraph = st.lists(_sentence, min_size=1, max_size=6).map(" ".join)
_document = st.lists(_paragraph, min_size=1, max_size=8).map("\n\n".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_document, limit=st.integers(min_value=8, max_value=200), overlap=st.integers(0, 40))
def test_property_fit_and_cover(doc, limit, overlap):
    tok = WordPieceTokenizer()
    measure = lambda s: len(tok.encode(s))  # noqa: E731
    chunks = chunk_text(doc, tok, limit, overlap_tokens=overlap)
    check_chunks(doc, chunks, limit, measure)


# --- the real tokenizer -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from engine.gguf_file import GGUFFile
    from engine.registry import pull
    from engine.tokenizer import Tokenizer

    path = pull("smollm2-135m", quiet=True)
    return Tokenizer.from_gguf(GGUFFile(str(path)))


@pytest.mark.parametrize("limit", [200, 700])
def test_real_tokenizer_long_document(smollm2_tokenizer, limit):
    tok = smollm2_tokenizer
    measure = lambda s: len(tok.encode(s))  # noqa: E731
    chunks = chunk_text(LONG_DOC, tok, limit, overlap_tokens=24)
    check_chunks(LONG_DOC, chunks, limit, measure)
    total = len(tok.encode(LONG_DOC))
    assert total > 4000  # the long example needs several chunks at a modest budget
    assert len(chunks) >= total // limit
    positions, levels = boundaries(LONG_DOC)
    strength = dict(zip(positions, levels))
    assert all(strength.get(c.end, 0) >= SENTENCE for c in chunks[:-1])
    check_overlaps(LONG_DOC, chunks, 24, lambda s: len(tok.encode(s)))
    # The chunks' text round-trips through the tokenizer (nothing lost at the cut points).
    for c in chunks:
        assert tok.decode(tok.encode(c.text)) == c.text


def test_real_tokenizer_tiny_and_medium(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert len(chunk_text(SHORT_DOC, tok, 1000)) == 1
    chunks = chunk_text(MEDIUM_DOC, tok, 400)
    check_chunks(MEDIUM_DOC, chunks, 400, lambda s: len(tok.encode(s)))
    assert len(chunks) >= 3


# --- structure: headings, lists, code blocks, CJK, sentences over the chunk ---------------------

from pipeline.structure import code_blocks, outline  # noqa: E402


def _sentences(prefix: str, n: int, words: int = 9) -> str:
    return " ".join(f"{prefix} sentence {i} " + " ".join(["word"] * (words - 3)) + "." for i in range(n))


def test_markdown_headings_are_the_first_cuts_and_give_section_paths(tok):
    doc = "\n\n".join([
        "# Guide", _sentences("Intro", 4),
        "## Install", _sentences("Install", 5),
        "### On Linux", _sentences("Linux", 5),
        "## Use", _sentences("Use", 5),
        "Setext Part\n===========", _sentences("Setext", 5),
    ])
    chunks = chunk_text(doc, tok, 120, overlap_tokens=30)
    check_chunks(doc, chunks, 120, lambda s: len(tok.encode(s)))
    # every section fits on its own, and no two fit together: one chunk per section, at its heading
    assert [c.text.split("\n")[0] for c in chunks] == ["# Guide", "## Install", "### On Linux", "## Use",
                                                       "Setext Part"]
    assert [c.section_path for c in chunks] == [("Guide",), ("Guide", "Install"), ("Guide", "Install", "On Linux"),
                                                ("Guide", "Use"), ("Setext Part",)]
    for c in chunks:
        assert not c.text.rstrip().split("\n")[-1].startswith("#"), "a heading ends a chunk"


def test_a_section_over_the_chunk_keeps_its_path_and_no_heading_is_left_at_a_chunk_end(tok):
    doc = "# Top\n\n" + _sentences("Top", 3) + "\n\n## Long part\n\n" + "\n\n".join(
        _sentences(f"P{i}", 3) for i in range(12)) + "\n\n## Short part\n\n" + _sentences("End", 2)
    chunks = chunk_text(doc, tok, 100, overlap_tokens=20)
    check_chunks(doc, chunks, 100, lambda s: len(tok.encode(s)))
    long_part = [c for c in chunks if c.section_path == ("Top", "Long part")]
    assert len(long_part) >= 3
    assert chunks[-1].section_path == ("Top", "Short part") and chunks[-1].text.startswith("## Short part")
    for c in chunks:
        assert not re.search(r"(^|\n)#+ [^\n]*$", c.text), c.text[-60:]


def test_plain_text_headings_of_a_licence():
    text = ("                    GNU GENERAL PUBLIC LICENSE\n                       Version 3, 29 June 2007\n\n"
            " Copyright (C) 2007 Free Software Foundation, Inc.\n\n                            Preamble\n\n"
            "  The GNU General Public License is a free, copyleft license.\n\n"
            "                       TERMS AND CONDITIONS\n\n  0. Definitions.\n\n"
            "  \"This License\" refers to version 3 of the GNU General Public License.\n\n"
            "  1. Source Code.\n\n  The \"source code\" for a work means the preferred form.\n\n"
            "Steps to follow:\n\n1. Install it\n\n2. Run it\n\n"  # a loose list is not headings
            "Thanks to everyone, and see you.\n")
    heads = [(h.level, h.title) for h in outline(text)]
    assert heads == [(1, "GNU GENERAL PUBLIC LICENSE"), (2, "Preamble"), (1, "TERMS AND CONDITIONS"),
                     (2, "0. Definitions"), (2, "1. Source Code")], heads


def test_lists_are_cut_between_items(tok):
    items = [f"- item {i}: " + " ".join(f"w{i}x{j}" for j in range(i % 5 + 3)) for i in range(40)]
    doc = "Shopping list\n" + "\n".join(items) + "\n"
    chunks = chunk_text(doc, tok, 60, overlap_tokens=15)
    check_chunks(doc, chunks, 60, lambda s: len(tok.encode(s)))
    assert len(chunks) > 3
    for c in chunks:
        lines = c.text.split("\n")
        assert all(line in items or line == "Shopping list" for line in lines), lines  # whole items only


CODE = "```bash\n# install the tool. Then run it.\npip install tool\n\n# configure. It works.\ntool init\n```"


def test_a_code_block_is_not_split_when_it_fits(tok):
    doc = _sentences("Before", 6) + "\n\n" + CODE + "\n\n" + _sentences("After", 6)
    assert code_blocks(doc) == [(doc.index("```"), doc.rindex("```") + 3)]
    assert [h.title for h in outline(doc)] == []  # "# install ..." is a comment, not a heading
    limit = len(tok.encode(CODE)) + 30
    for overlap in (0, 20):
        chunks = chunk_text(doc, tok, limit, overlap_tokens=overlap)
        check_chunks(doc, chunks, limit, lambda s: len(tok.encode(s)))
        assert any(CODE in c.text for c in chunks), [c.text for c in chunks]
        for c in chunks:  # a chunk holds the whole block or none of it
            assert c.text.count("```") in (0, 2), c.text


def test_a_code_block_over_the_chunk_is_cut_at_its_line_ends(tok):
    block = "```python\n" + "\n".join(f"value_{i} = compute({i}). result" for i in range(60)) + "\n```"
    doc = "Intro sentence here.\n\n" + block + "\n\nOutro sentence here."
    chunks = chunk_text(doc, tok, 80, overlap_tokens=0)
    check_chunks(doc, chunks, 80, lambda s: len(tok.encode(s)))
    lines = set(block.split("\n"))
    for c in chunks:
        if "value_" in c.text:
            assert all(line in lines for line in c.text.split("\n") if "value_" in line), c.text


def test_cjk_text_without_spaces_is_cut_at_its_full_stops(tok):
    sentences = [f"这是第{i}个句子，它讲述了一个关于文档切分的小故事" + ("！" if i % 3 == 0 else "。") for i in range(30)]
    doc = "".join(sentences)
    chunks = chunk_text(doc, tok, 120, overlap_tokens=30)
    check_chunks(doc, chunks, 120, lambda s: len(tok.encode(s)))
    assert len(chunks) > 5
    for c in chunks:
        assert c.text[-1] in "。！", c.text[-10:]
        assert c.text.startswith("这是第"), c.text[:10]  # starts on a sentence, overlap included
    assert check_overlaps(doc, chunks, 30, lambda s: len(tok.encode(s))) > 0


def test_a_sentence_longer_than_the_chunk_is_cut_at_words_and_only_it(tok):
    giant = "This giant sentence " + " ".join(f"goes{i}" for i in range(150)) + " and ends here."
    doc = _sentences("Short", 3) + " " + giant + " " + _sentences("Later", 3)
    chunks = chunk_text(doc, tok, 60, overlap_tokens=0)
    check_chunks(doc, chunks, 60, lambda s: len(tok.encode(s)))
    words = set(doc.split())
    for c in chunks:
        assert all(w in words for w in c.text.split()), "a cut inside a word"
    shorts = re.findall(r"(?:Short|Later) sentence \d [^.]*\.", doc)
    for s in shorts:  # the short sentences are never cut
        assert any(s in c.text for c in chunks), s


def test_an_early_sentence_end_beats_a_cut_inside_the_next_sentence(tok):
    first = "A short one here."
    second = "Then " + " ".join(f"w{i}" for i in range(60)) + " end."
    doc = first + " " + second
    n_first = len(tok.encode(first))
    limit = len(tok.encode(second)) + 5  # the second fits alone, not with the first
    assert n_first < limit * 0.5  # the first's end is below min_fill: cutting at the limit alone would cut mid-sentence
    chunks = chunk_text(doc, tok, limit, overlap_tokens=0)
    assert [c.text for c in chunks] == [first, second]


_md_block = st.one_of(
    _paragraph,
    st.builds(lambda level, title: "#" * level + " " + title, st.integers(1, 4), _word),
    st.lists(_word, min_size=1, max_size=6).map(lambda ws: "```\n" + "\n".join(ws) + "\n```"),
    st.lists(_sentence, min_size=1, max_size=5).map(lambda ss: "\n".join("- " + s for s in ss)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(_md_block, min_size=1, max_size=10), limit=st.integers(min_value=8, max_value=200),
       overlap=st.integers(0, 40))
def test_property_markdown_fit_and_cover(blocks, limit, overlap):
    doc = "\n\n".join(blocks)
    tok = WordPieceTokenizer()
    measure = lambda s: len(tok.encode(s))  # noqa: E731
    chunks = chunk_text(doc, tok, limit, overlap_tokens=overlap)
    check_chunks(doc, chunks, limit, measure)
    check_overlaps(doc, chunks, max(0, min(overlap, limit // 4)), measure)

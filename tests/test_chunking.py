"""Token-budgeted chunking: pure logic with a stand-in tokenizer, then the real SmolLM2 tokenizer."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.chunking import PARAGRAPH, SENTENCE, ChunkingError, boundaries, chunk_text

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
    # ... and most of the time a paragraph end.
    assert sum(level == PARAGRAPH for level in ends) >= len(ends) // 2, ends
    for c in chunks[:-1]:
        assert re.search(r"[.!?:)\w]$", c.text), c.text[-40:]


def test_overlap_present_and_bounded(tok):
    chunks = chunk_text(LONG_DOC, tok, 300, overlap_tokens=40)
    assert len(chunks) > 3
    for a, b in zip(chunks, chunks[1:]):
        shared = LONG_DOC[b.start:a.end].strip()
        assert shared, "consecutive chunks share some text"
        assert len(tok.encode(shared)) <= 40
        assert a.text.endswith(shared)
        assert b.text.startswith(shared)
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
    for a, b in zip(chunks, chunks[1:]):
        shared = LONG_DOC[b.start:a.end].strip()
        assert shared and len(tok.encode(shared)) <= 24
    # The chunks' text round-trips through the tokenizer (nothing lost at the cut points).
    for c in chunks:
        assert tok.decode(tok.encode(c.text)) == c.text


def test_real_tokenizer_tiny_and_medium(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert len(chunk_text(SHORT_DOC, tok, 1000)) == 1
    chunks = chunk_text(MEDIUM_DOC, tok, 400)
    check_chunks(MEDIUM_DOC, chunks, 400, lambda s: len(tok.encode(s)))
    assert len(chunks) >= 3

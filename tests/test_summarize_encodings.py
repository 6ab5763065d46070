"""Documents that are not UTF-8: Latin-1 / Windows-1252 and UTF-16 with a byte order mark
are read, not skipped as "binary", and the run says which encoding it assumed (the JSONL record, the
Markdown/HTML report, a note on stderr)."""
from __future__ import annotations

from pathlib import Path

import pytest

from jobs.summary_unit import ChunkSummary
from pipeline.summarize.documents import Document, Skipped, collect_documents, read_document
from pipeline.summarize.follow import DocState
from pipeline.summarize.plan import DocPlan
from pipeline.summarize.report import html_report, markdown_report

# Long enough for a detector: a short run of accented letters fits many code pages.
FRENCH = ("Le café de la gare était fermé ce matin-là. Nous avons marché jusqu'à la rivière, où les élèves "
          "jouaient près du pont, et le garçon du boulanger nous a salués. Après le déjeuner, la pluie a cessé "
          "et nous sommes rentrés à pied par la forêt.\n")


@pytest.mark.parametrize("codec, assumed, note", [
    ("latin-1", {"cp1252", "latin_1", "iso8859_15"}, "guessed by charset-normalizer"),
    ("cp1252", {"cp1252"}, "guessed by charset-normalizer"),
    ("utf-16", {"utf-16"}, "read as UTF-16 (byte order mark)"),  # Python writes the mark (LE here)
    ("utf-16-be-bom", {"utf-16"}, "read as UTF-16 (byte order mark)"),
    ("utf-32", {"utf-32"}, "read as UTF-32 (byte order mark)"),
])
def test_a_document_in_another_encoding_is_read_and_says_how(tmp_path: Path, codec: str, assumed: set[str],
                                                             note: str):
    data = b"\xfe\xff" + FRENCH.encode("utf-16-be") if codec == "utf-16-be-bom" else FRENCH.encode(codec)
    path = tmp_path / "doc.txt"
    path.write_bytes(data)
    doc = read_document(path)
    assert isinstance(doc, Document), doc
    assert doc.text == FRENCH
    assert doc.encoding in assumed
    assert doc.encoding_note is not None and note in doc.encoding_note and doc.encoding in doc.encoding_note.lower()


def test_utf8_needs_no_note_and_binary_is_still_skipped(tmp_path: Path):
    (tmp_path / "plain.md").write_text(FRENCH, encoding="utf-8")
    (tmp_path / "bom.md").write_bytes(b"\xef\xbb\xbf" + FRENCH.encode())
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (tmp_path / "broken16.txt").write_bytes(FRENCH.encode("utf-16")[:-1])  # an odd byte count: not UTF-16
    docs, skipped = collect_documents([str(tmp_path)])
    assert sorted((Path(d.path).name, d.text == FRENCH, d.encoding_note) for d in docs) == [
        ("bom.md", True, None), ("plain.md", True, None)]
    reasons = {Path(s.path).name: s.reason for s in skipped}
    assert reasons["image.png"] == "binary (contains NUL bytes)"
    assert reasons["broken16.txt"].startswith("not valid UTF-16 despite its byte order mark")


def test_the_record_and_the_reports_name_the_assumed_encoding(tmp_path: Path):
    path = tmp_path / "latin.txt"
    path.write_bytes(FRENCH.encode("latin-1"))
    doc = read_document(path)
    assert isinstance(doc, Document)
    plan = DocPlan(index=0, doc=doc, chunks=[], map_ids=["m0"], map_messages=[], reduces=[], prompt_tokens=[],
                   title="Latin")
    state = DocState(plan, 0.0)
    state.results["m0"] = ChunkSummary(summary="A walk.", finish_reason="stop", prompt_tokens=50, completion_tokens=5,
                                       seconds=1.0, prefix_hit_tokens=0, draft_tokens=0, accepted_tokens=0, inputs=1,
                                       generation_id="m0", worker="w")
    state.ended_at = 1.0
    record = state.record("smollm2-135m")
    assert record["encoding"] == doc.encoding
    assert record["encoding_note"] == f"read as {doc.encoding} (guessed by charset-normalizer)"
    settings = {"model": "smollm2-135m"}
    md = markdown_report([record], [Skipped("x.bin", "binary")], settings=settings, wall_seconds=1.0)
    assert f"read as {doc.encoding} (guessed by charset-normalizer)" in md
    page = html_report([record], [], settings=settings, wall_seconds=1.0)
    assert f"read as {doc.encoding} (guessed by charset-normalizer)" in page

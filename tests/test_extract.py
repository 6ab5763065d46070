"""`rqllm extract` on the example documents with SmolLM2 in an embedded cluster: one object per document,
valid for the schema (jsonschema); CSV flattens the top-level fields; a schema that does not compile or
a file that is not JSON is refused before anything starts."""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from pipeline.extract import Extraction, extract, write_csv, write_output
from pipeline.summarize.documents import Skipped
from pipeline.extract_merge import chunk_messages, join_arrays
from pipeline.summarize import PromptMeter, SummarizeError
from tests.model_available import needs_model
from tests.redis_server import redis_server  # noqa: F401  (session fixture)

pytestmark = needs_model("smollm2-135m")
ROOT = Path(__file__).resolve().parent.parent
M = "smollm2-135m"
SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string", "maxLength": 80},
                         "topics": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
                         "kind": {"enum": ["design", "history", "notes", "other"]}},
          "required": ["title", "topics", "kind"], "additionalProperties": False}


def test_one_valid_object_per_example_document_and_csv(tmp_path: Path):
    # The example documents, the long one cut to its first 9,000 characters (still two chunks at this KV
    # budget): whole, it took 75 s of CI's 20 minutes.
    docs = tmp_path / "docs"
    docs.mkdir()
    for p in (ROOT / "examples").iterdir():
        if p.is_file():
            (docs / p.name).write_text(p.read_text(encoding="utf-8")[:9000], encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    report = extract([str(docs)], schema=SCHEMA, output=out, model=M, workers=1, threads=2,
                     kv_budget="2048tok", max_tokens=150, err=err)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    names = sorted(p.name for p in docs.iterdir())
    assert sorted(Path(r["path"]).name for r in records) == names
    complete = 0
    for r in records:
        if r["data"] is not None:
            jsonschema.validate(r["data"], SCHEMA)
            assert r["finish_reason"] == "stop" and r["error"] is None
            complete += 1
        else:
            assert r["finish_reason"] == "length" and "max_tokens" in r["error"]
    assert complete >= len(names) - 1 and report.failed == len(names) - complete
    assert any(r["chunks"] > 1 for r in records)  # a document over the budget went through map and merge
    assert "done:" in err.getvalue()

    md = io.StringIO()
    write_output(md, "md", report, SCHEMA, {"model": M})
    for e in report.extractions:  # every document, with its object or under Failed with the reason
        assert (f"## {e.path}\n\n```json\n{json.dumps(e.data, ensure_ascii=False, indent=2)}\n```" in md.getvalue()
                if e.data is not None else f"- `{e.path}`: {e.error}" in md.getvalue())

    table = io.StringIO()
    write_csv(table, report.extractions, SCHEMA)
    rows = list(csv.reader(io.StringIO(table.getvalue())))
    assert rows[0] == ["path", "title", "topics", "kind", "error"]
    by_path = {row[0]: row for row in rows[1:]}
    for e in report.extractions:
        if e.data is not None:
            row = by_path[e.path]
            assert row[1] == e.data["title"] and json.loads(row[2]) == e.data["topics"] and row[3] == e.data["kind"]


def test_csv_columns_and_failures():
    table = io.StringIO()
    write_csv(table, [Extraction("a.txt", data={"title": "T", "extra": {"x": 1}}),
                      Extraction("b.txt", error="max_tokens ended the object")], SCHEMA)
    rows = list(csv.reader(io.StringIO(table.getvalue())))
    assert rows == [["path", "title", "topics", "kind", "extra", "error"],
                    ["a.txt", "T", "", "", '{"x": 1}', ""],
                    ["b.txt", "", "", "", "", "max_tokens ended the object"]]


def _report_extractions() -> list[Extraction]:
    return [Extraction("docs/a<1>.md", data={"title": "Alpha & co", "topics": ["x"]}, finish_reason="stop",
                       chunks=3, tokens_in=1200, tokens_out=40),
            Extraction("b.txt", error="max_tokens ended the object before it was complete", finish_reason="length",
                       tokens_in=300, tokens_out=150)]


def test_extraction_report_in_markdown():
    from pipeline.extract import ExtractReport

    report = ExtractReport(_report_extractions(), [Skipped("c.bin", "binary (contains NUL bytes)")], 2.5)
    out = io.StringIO()
    write_output(out, "md", report, SCHEMA, {"model": M, "schema": "s.json"})
    md = out.getvalue()
    assert md.startswith("# Extractions\n\n1 object extracted, 1 failed, 1 skipped in 2.5 s; 4 chunks; "
                         "1,500 tokens in, 190 out.\n\n_model: smollm2-135m · schema: s.json_\n")
    assert ('## docs/a<1>.md\n\n```json\n{\n  "title": "Alpha & co",\n  "topics": [\n    "x"\n  ]\n}\n```\n\n'
            "_3 chunks, merged · 1,200 tokens in, 40 out_") in md
    assert "## Failed\n\n- `b.txt`: max_tokens ended the object before it was complete\n" in md
    assert "## Skipped\n\n- `c.bin`: binary (contains NUL bytes)\n" in md
    assert "## b.txt" not in md


def test_extraction_report_in_html_escapes_every_text():
    from html.parser import HTMLParser

    from pipeline.extract import ExtractReport

    report = ExtractReport(_report_extractions(), [Skipped("<c>.bin", "binary")], 2.5)
    out = io.StringIO()
    write_output(out, "html", report, SCHEMA, {"model": M, "schema": "<s>.json"})
    page = out.getvalue()
    assert "<title>Extractions</title>" in page and "<h2>docs/a&lt;1&gt;.md</h2>" in page
    assert "&quot;title&quot;: &quot;Alpha &amp; co&quot;" in page
    assert "schema: &lt;s&gt;.json" in page and "<code>&lt;c&gt;.bin</code>: binary" in page
    assert "<li><code>b.txt</code>: max_tokens ended the object before it was complete</li>" in page

    class Tags(HTMLParser):  # every element the page opens is closed: no text became markup
        def __init__(self):
            super().__init__()
            self.open: list[str] = []

        def handle_starttag(self, tag, attrs):
            if tag not in ("meta",):
                self.open.append(tag)

        def handle_endtag(self, tag):
            assert self.open.pop() == tag

    parser = Tags()
    parser.feed(page)
    assert parser.open == []


def test_extract_command_writes_a_report_for_an_md_output(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "empty.txt").write_text("  \n")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    p = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", "extract",
                        str(tmp_path / "docs"), "--schema", str(schema), "-m", M, "-o", str(tmp_path / "out.md")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr  # nothing extracted
    md = (tmp_path / "out.md").read_text()
    assert md.startswith("# Extractions\n\n0 objects extracted, 1 skipped in ")
    assert f"`{tmp_path / 'docs' / 'empty.txt'}`: empty" in md and "schema: s.json" in md


def test_long_document_is_chunked_to_fit():
    meter = PromptMeter.for_model(M)
    text = "".join(f"Paragraph {i}. The item number {i} is described here in a few words.\n\n" for i in range(300))
    prompts = chunk_messages(text, "long.txt", SCHEMA, "Be brief.", meter, 600)
    assert len(prompts) > 1 and all(meter.count(m) <= 600 for m in prompts)
    assert all("Paragraph" in m[1]["content"] and "part " in m[1]["content"] for m in prompts)
    assert all(m[0]["content"].endswith("\nBe brief.") and '"topics"' in m[0]["content"] for m in prompts)
    assert "Paragraph 299." in prompts[-1][1]["content"] and "Paragraph 0." in prompts[0][1]["content"]
    assert len(chunk_messages("A short note.", "short.txt", SCHEMA, None, meter, 600)) == 1


def test_arrays_joined_without_duplicates_in_order():
    parts = [{"title": "A", "topics": ["x", "y"]}, {"title": "B", "topics": ["y", "z", "w", "v"]}]
    merged = join_arrays({"title": "A", "topics": ["q"], "kind": "notes"}, parts, SCHEMA)
    assert merged == {"title": "A", "topics": ["x", "y", "z", "w"], "kind": "notes"}  # maxItems 4


def test_bad_schema_refused_before_anything_starts(tmp_path: Path):
    with pytest.raises(SummarizeError, match="Invalid type: strng"):
        extract([str(ROOT / "examples")], schema={"type": "strng"}, output=io.StringIO(), model=M)
    bad = tmp_path / "s.json"
    bad.write_text("{not json")
    p = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", "extract",
                        str(ROOT / "examples"), "--schema", str(bad)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "not a JSON file" in p.stderr


def test_extract_on_a_redis_url_with_its_workers(redis_server: str, tmp_path: Path):  # noqa: F811
    """With REDIS_URL the command only submits and waits: the jobs run on the workers serving that Redis,
    and the run is a batch there (extract_<run id>)."""
    from redis import Redis

    from pipeline.client import Client
    from pipeline.embedded import WorkerProcess, stop_workers, worker_argv
    from tests.conftest_redis import wait_for_workers

    Redis.from_url(redis_server).flushdb()
    worker = WorkerProcess(worker_argv(redis_server, M, threads=2, name="extract-w1", kv_budget="64MiB"),
                           str(tmp_path / "w.log"))
    try:
        wait_for_workers(Redis.from_url(redis_server), ["extract-w1"])
        out = io.StringIO()
        report = extract([str(ROOT / "examples" / "team-sync-notes.md")], schema=SCHEMA, output=out, model=M,
                         max_tokens=150, redis_url=redis_server, err=io.StringIO(),
                         instructions="The topics are the names of the people at the meeting.")
    finally:
        stop_workers([worker])
    (record,) = [json.loads(line) for line in out.getvalue().splitlines()]
    jsonschema.validate(record["data"], SCHEMA)
    assert report.failed == 0
    batches = [b for b in Client(redis_server).list_batches() if b.batch_id.startswith("extract_")]
    assert len(batches) == 1 and batches[0].done == 1
    (job_id,) = [jid for _, jid in Client(redis_server).batch_entries(batches[0].batch_id)]
    result = Client(redis_server).result(job_id)
    assert result.status == "done" and json.loads(result.text) == record["data"]

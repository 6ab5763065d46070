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

from pipeline.extract import Extraction, extract, write_csv
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
    out, err = io.StringIO(), io.StringIO()
    report = extract([str(ROOT / "examples")], schema=SCHEMA, output=out, model=M, workers=1, threads=2,
                     kv_budget="64MiB", max_tokens=150, err=err)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    names = sorted(p.name for p in (ROOT / "examples").iterdir() if p.is_file())
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

"""`rqllm extract`: the same fields out of every document, as one JSON object per document valid for a
JSON schema (constrained decoding, engine.constraint), written as JSONL or as a CSV of the top-level
fields. The bulk sibling of `rqllm summarize`: the same documents (pipeline.summarize.documents), one
batch of jobs through pipeline.client.Client, an embedded cluster without REDIS_URL.

One job per document; a document longer than a worker's KV budget leaves room for is split into chunks
(pipeline.chunking), one job each, and a merge job combines their objects (pipeline.extract_merge).
"""
from __future__ import annotations

import csv
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from pydantic import ValidationError

from engine.defaults import DEFAULT_KV_BUDGET, DEFAULT_MODEL
from engine.params import SamplingParams
from jobs.defaults import JOB_TIMEOUT
from jobs.redis_conn import reachable, redis_url_from_env
from jobs.schemas import GenerationJob, JobResult, describe_errors
from pipeline.client import TASK_GENERATE, Client
from pipeline.defaults import RUN_RESULT_TTL, RUN_STREAM_TTL
from pipeline.enqueue import TaskCall
from pipeline.extract_merge import chunk_messages, join_arrays, reduce_messages
from pipeline.summarize.documents import DEFAULT_MAX_BYTES, Skipped, collect_documents
from pipeline.summarize.errors import SummarizeError
from pipeline.summarize.plan import PromptMeter, kv_capacity
from pipeline.summarize.report import Progress, extraction_html, extraction_markdown
from pipeline.summarize.run import check_model, open_model, remote_plan, run_embedded

DEFAULT_MAX_TOKENS = 512
FORMATS = ("jsonl", "csv", "md", "html")  # md, html: a report at the end (pipeline.summarize.report)
SYSTEM = ("You extract information from documents. Answer with one JSON object that follows this JSON schema; "
          "use only facts stated in the document.\nSchema: {schema}")


@dataclass
class Extraction:
    """One document's outcome: `data` is the object (None when the job failed or max_tokens cut it)."""

    path: str
    data: dict[str, Any] | None = None
    error: str | None = None
    finish_reason: str | None = None
    chunks: int = 1  # more than one: a merge job combined the chunks' objects
    tokens_in: int = 0
    tokens_out: int = 0

    def record(self) -> dict[str, Any]:
        return {"path": self.path, "data": self.data, "error": self.error, "finish_reason": self.finish_reason,
                "chunks": self.chunks, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out}


@dataclass
class DocRun:
    """A document's jobs: one per chunk, then (several chunks) the merge; `done` once its outcome is known."""

    extraction: Extraction
    maps: list[GenerationJob]
    reduce: GenerationJob | None = None
    parts: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False

    def waiting_for(self) -> list[str]:
        return [self.reduce.id] if self.reduce is not None else [j.id for j in self.maps]

    def advance(self, found: dict[str, JobResult], schema: dict[str, Any]) -> bool | None:
        """Take the results that came; True when the chunk objects are in and a merge job is needed."""
        e = self.extraction
        if self.reduce is not None:
            if self.reduce.id in found:
                self._count(found[self.reduce.id])
                data, e.error = parse_output(found[self.reduce.id])
                e.finish_reason = found[self.reduce.id].finish_reason
                e.data = None if data is None else join_arrays(data, self.parts, schema)
                self.done = True
            return None
        if any(j.id not in found for j in self.maps):
            return None
        outcomes = [parse_output(found[j.id]) for j in self.maps]
        for j in self.maps:
            self._count(found[j.id])
        self.parts = [data for data, _ in outcomes if data is not None]
        if len(self.maps) == 1 or len(self.parts) <= 1:
            e.data = self.parts[0] if self.parts else None
            e.error = None if self.parts else next(error for _, error in outcomes)
            e.finish_reason = found[self.maps[-1].id].finish_reason
            self.done = True
            return None
        return True

    def _count(self, result: JobResult) -> None:
        self.extraction.tokens_in += result.prompt_tokens
        self.extraction.tokens_out += result.completion_tokens


def submit(client: Client, batch_id: str, jobs: Sequence[GenerationJob]) -> None:
    jobs = [g.model_copy(update={"batch_id": batch_id}) for g in jobs]  # not part of the id: no re-validation
    calls = [TaskCall(g.id, g.model, TASK_GENERATE, (g.to_payload(),), f"extract {g.custom_id}", custom_id=g.custom_id)
             for g in jobs]
    client.submit_calls(batch_id, calls, timeout=JOB_TIMEOUT, retries=1, extend=True)


@dataclass
class ExtractReport:
    extractions: list[Extraction] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def failed(self) -> int:
        return sum(1 for e in self.extractions if e.data is None)


def parse_output(result: JobResult | None) -> tuple[dict[str, Any] | None, str | None]:
    """(object, error) from a job's result."""
    if result is None:
        return None, "no result"
    if result.status != "done":
        return None, f"{result.error.code}: {result.error.message}" if result.error else "failed"
    if result.finish_reason == "length":
        return None, "max_tokens ended the object before it was complete (raise --max-tokens)"
    try:
        value = json.loads(result.text)
    except ValueError as exc:  # cannot happen under the schema's grammar; said rather than hidden
        return None, f"output is not JSON: {exc}"
    return (value, None) if isinstance(value, dict) else (None, "output is not a JSON object")


def write_jsonl(out: IO[str], extractions: Sequence[Extraction]) -> None:
    for e in extractions:
        out.write(json.dumps(e.record(), ensure_ascii=False) + "\n")


def write_csv(out: IO[str], extractions: Sequence[Extraction], schema: dict[str, Any]) -> None:
    """One row per document: path, the schema's top-level properties in its order (others found after
    them), error. Objects and arrays are written as JSON."""
    columns = list(schema.get("properties") or {})
    for e in extractions:
        for k in e.data or {}:
            if k not in columns:
                columns.append(k)
    writer = csv.writer(out)
    writer.writerow(["path", *columns, "error"])
    for e in extractions:
        data = e.data or {}
        cells = [json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else ("" if v is None else v)
                 for v in (data.get(c) for c in columns)]
        writer.writerow([e.path, *cells, e.error or ""])


def write_output(out: IO[str], fmt: str, report: ExtractReport, schema: dict[str, Any],
                 settings: dict[str, Any]) -> None:
    """The run's output in `fmt` (FORMATS): JSONL or CSV rows, or the Markdown or HTML report."""
    if fmt == "csv":
        write_csv(out, report.extractions, schema)
    elif fmt in ("md", "html"):
        render = extraction_markdown if fmt == "md" else extraction_html
        out.write(render([e.record() for e in report.extractions], report.skipped, settings=settings,
                         wall_seconds=report.wall_seconds))
    else:
        write_jsonl(out, report.extractions)


def extract(paths: Sequence[str], *, schema: dict[str, Any], output: IO[str], fmt: str = "jsonl",
            instructions: str | None = None, model: str = DEFAULT_MODEL, workers: int | None = None,
            threads: int | None = None, kv_budget: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
            max_bytes: int = DEFAULT_MAX_BYTES, redis_url: str | None = None, repack: bool = True,
            err: IO[str] | None = None, schema_name: str = "schema") -> ExtractReport:
    """Extract an object valid for `schema` from every readable document under `paths` (see the module).
    fmt: one of FORMATS; schema_name: how the report's settings name the schema (its file)."""
    import sys

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    err = err if err is not None else sys.stderr
    settings = {"model": model, "schema": schema_name, "max tokens": max_tokens}
    if instructions:
        settings["instructions"] = instructions
    t0 = time.monotonic()
    fmt_request = {"type": "json_schema", "json_schema": {"name": "extraction", "schema": schema, "strict": True}}
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative="prompt_lookup",
                                response_format=fmt_request)
    except ValidationError as exc:  # the schema does not compile: refused before anything starts
        raise SummarizeError(f"--schema: {describe_errors(exc)}") from None
    url = redis_url if redis_url is not None else redis_url_from_env()
    remote = reachable(url) if url else None
    check_model(model, Client(connection=remote) if remote is not None else None)
    info = open_model(model) if remote is None else None  # read once: planner, memory guard, split
    try:
        docs, skipped = collect_documents(paths, max_bytes=max_bytes)
        for s in skipped:
            err.write(f"skipped {s.path}: {s.reason}\n")
        report = ExtractReport(skipped=skipped)
        if not docs:
            err.write("nothing to extract from\n")
            report.wall_seconds = time.monotonic() - t0
            if fmt in ("md", "html"):
                write_output(output, fmt, report, schema, settings)
            return report
        budget_text = kv_budget or DEFAULT_KV_BUDGET
        if remote is not None:
            capacity, meter = remote_plan(Client(connection=remote), model, kv_budget, err)
        else:
            capacity, meter = kv_capacity(info, budget_text), PromptMeter.for_model(info)
        run_id = uuid.uuid4().hex[:12]
        prompt_limit = capacity - max_tokens
        runs: list[DocRun] = []
        for d in docs:
            prompts = chunk_messages(d.text, d.path, schema, instructions, meter, prompt_limit)
            runs.append(DocRun(Extraction(d.path, chunks=len(prompts)), [
                GenerationJob(model=model, messages=m, params=params, metadata={"extract": d.path, "chunk": i},
                              custom_id=d.path if len(prompts) == 1 else f"{d.path}#part{i + 1}")
                for i, m in enumerate(prompts)]))
        chunks = sum(len(r.maps) for r in runs)
        err.write(f"extracting from {len(docs)} document{'s' if len(docs) != 1 else ''} ({chunks} chunks) with "
                  f"{model}\n")

        def run(connection: Any, health: Callable[[], None] | None) -> None:
            client = Client(connection=connection, result_ttl=RUN_RESULT_TTL, stream_ttl=RUN_STREAM_TTL)
            batch_id = client.open_batch(f"extract_{run_id}", metadata={"extract": len(docs)})
            submit(client, batch_id, [j for r in runs for j in r.maps])
            progress = Progress(len(runs), chunks, stream=err)
            maps_done = [0] * len(runs)
            finished = failed = 0
            try:
                while finished < len(runs):
                    waiting = [(i, r) for i, r in enumerate(runs) if not r.done]
                    found = client.results_for(sorted({j for _, r in waiting for j in r.waiting_for()}))
                    for i, r in waiting:
                        if r.reduce is None:
                            maps_done[i] = sum(j.id in found for j in r.maps)
                        if r.advance(found, schema):
                            messages = reduce_messages(r.extraction.path, schema, instructions, r.parts, meter,
                                                       prompt_limit)
                            r.reduce = GenerationJob(model=model, messages=messages, params=params,
                                                     custom_id=f"{r.extraction.path}#merge",
                                                     metadata={"extract": r.extraction.path, "merge": len(r.parts)})
                            submit(client, batch_id, [r.reduce])
                        if r.done:
                            finished += 1
                            if r.extraction.error is not None:
                                failed += 1
                                progress.message(f"failed {r.extraction.path}: {r.extraction.error}")
                    progress.update(finished, sum(maps_done), failed)
                    if finished < len(runs):
                        if health is not None:
                            health()
                        time.sleep(0.3)
            finally:
                progress.close()

        if remote is not None:
            run(remote, None)
        else:
            run_embedded(model, chunks, info=info, kv_budget=budget_text, workers=workers, threads=threads,
                         repack=repack, err=err, run=run)
        extractions = [r.extraction for r in runs]
        report.extractions = extractions
        report.wall_seconds = time.monotonic() - t0
        write_output(output, fmt, report, schema, settings)
        err.write(f"done: {len(extractions) - report.failed} extracted, {report.failed} failed, "
                  f"{len(skipped)} skipped; {report.wall_seconds:.1f} s\n")
        return report
    finally:
        if info is not None:
            info.close()

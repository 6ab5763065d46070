"""`rqllm extract`: the same fields out of every document, as one JSON object per document valid for a
JSON schema (constrained decoding, engine.constraint), written as JSONL or as a CSV of the top-level
fields. The bulk sibling of `rqllm summarize`: the same documents (pipeline.summarize.documents), one
batch of jobs through pipeline.client.Client, an embedded cluster without REDIS_URL.

One job per document. A document longer than a worker's KV budget leaves room for is cut to fit (the
record says "truncated"); map-reduce over chunks is not done yet.
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
from jobs.redis_conn import connect, reachable, redis_url_from_env
from jobs.schemas import GenerationJob, JobResult, describe_errors
from pipeline.client import Client
from pipeline.summarize.documents import DEFAULT_MAX_BYTES, Document, collect_documents
from pipeline.summarize.errors import SummarizeError
from pipeline.summarize.plan import PromptMeter, kv_capacity, worker_kv_budget
from pipeline.summarize.run import check_model, check_model_file, remote_plan

DEFAULT_MAX_TOKENS = 512
SYSTEM = ("You extract information from documents. Answer with one JSON object that follows this JSON schema; "
          "use only facts stated in the document.\nSchema: {schema}")
JOB_TIMEOUT = 1800
RESULT_TTL = 24 * 3600


@dataclass
class Extraction:
    """One document's outcome: `data` is the object (None when the job failed or max_tokens cut it)."""

    path: str
    data: dict[str, Any] | None = None
    error: str | None = None
    finish_reason: str | None = None
    truncated: bool = False
    tokens_in: int = 0
    tokens_out: int = 0

    def record(self) -> dict[str, Any]:
        return {"path": self.path, "data": self.data, "error": self.error, "finish_reason": self.finish_reason,
                "truncated": self.truncated, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out}


@dataclass
class ExtractReport:
    extractions: list[Extraction] = field(default_factory=list)
    skipped: int = 0
    wall_seconds: float = 0.0

    @property
    def failed(self) -> int:
        return sum(1 for e in self.extractions if e.data is None)


def document_messages(doc_text: str, path: str, schema: dict[str, Any], instructions: str | None) -> list[dict]:
    system = SYSTEM.format(schema=json.dumps(schema, ensure_ascii=False))
    if instructions:
        system += "\n" + instructions
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Document {path}:\n\n{doc_text}"}]


def fitted_messages(doc: Document, schema: dict[str, Any], instructions: str | None, meter: PromptMeter,
                    prompt_limit: int) -> tuple[list[dict], bool]:
    """The document's prompt, its text cut (at a line end where there is one) until it fits prompt_limit."""
    text = doc.text
    messages = document_messages(text, doc.path, schema, instructions)
    n = meter.count(messages)
    if n <= prompt_limit:
        return messages, False
    while n > prompt_limit and text:
        keep = max(0, int(len(text) * prompt_limit / n * 0.95) - 1)
        cut = text.rfind("\n", 0, keep)
        text = text[:cut if cut > keep // 2 else keep]
        messages = document_messages(text, doc.path, schema, instructions)
        n = meter.count(messages)
    if n > prompt_limit:
        raise SummarizeError(f"the KV budget leaves {prompt_limit} prompt tokens: too few for the schema and "
                             "instructions alone; raise --kv-budget or lower --max-tokens")
    return messages, True


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


def extract(paths: Sequence[str], *, schema: dict[str, Any], output: IO[str], fmt: str = "jsonl",
            instructions: str | None = None, model: str = DEFAULT_MODEL, workers: int | None = None,
            threads: int | None = None, kv_budget: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
            max_bytes: int = DEFAULT_MAX_BYTES, redis_url: str | None = None, repack: bool = True,
            err: IO[str] | None = None) -> ExtractReport:
    """Extract an object valid for `schema` from every readable document under `paths` (see the module)."""
    import sys

    err = err if err is not None else sys.stderr
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
    if remote is None:
        check_model_file(model, None)
    docs, skipped = collect_documents(paths, max_bytes=max_bytes)
    for s in skipped:
        err.write(f"skipped {s.path}: {s.reason}\n")
    report = ExtractReport(skipped=len(skipped))
    if not docs:
        err.write("nothing to extract from\n")
        return report
    budget_text = kv_budget or DEFAULT_KV_BUDGET
    if remote is not None:
        capacity, meter = remote_plan(Client(connection=remote), model, kv_budget, err)
    else:
        capacity, meter = kv_capacity(model, budget_text), PromptMeter.for_model(model)
    run_id = uuid.uuid4().hex[:12]
    jobs: list[GenerationJob] = []
    extractions: list[Extraction] = []
    for d in docs:
        messages, truncated = fitted_messages(d, schema, instructions, meter, capacity - max_tokens)
        if truncated:
            err.write(f"note: {d.path} is longer than the KV budget holds: its end is left out\n")
        jobs.append(GenerationJob(model=model, messages=messages, params=params, custom_id=d.path,
                                  metadata={"extract": d.path}))
        extractions.append(Extraction(d.path, truncated=truncated))
    err.write(f"extracting from {len(docs)} document{'s' if len(docs) != 1 else ''} with {model}\n")

    def run(connection: Any, health: Callable[[], None] | None) -> None:
        client = Client(connection=connection, result_ttl=RESULT_TTL)
        client.submit_batch(jobs, batch_id=f"extract_{run_id}", timeout=JOB_TIMEOUT, retries=1,
                            metadata={"extract": len(jobs)})
        pending = {j.id for j in jobs}
        while pending:
            found = client.results_for(sorted(pending))
            for job, e in zip(jobs, extractions):
                if job.id in found and e.finish_reason is None and e.error is None:
                    res = found[job.id]
                    e.data, e.error = parse_output(res)
                    e.finish_reason, e.tokens_in, e.tokens_out = res.finish_reason, res.prompt_tokens, res.completion_tokens
                    err.write(f"[{sum(x.finish_reason is not None or x.error is not None for x in extractions)}"
                              f"/{len(extractions)}] {e.path}: {'ok' if e.error is None else e.error}\n")
            pending -= set(found)
            if pending:
                if health is not None:
                    health()
                time.sleep(0.3)

    if remote is not None:
        run(remote, None)
    else:
        from pipeline.embedded import choose_embedded_split, embedded_cluster

        worker_budget = worker_kv_budget(model, budget_text)
        split = choose_embedded_split(model, len(jobs), workers=workers, threads=threads, kv_budget=worker_budget,
                                      repack=repack)
        with embedded_cluster(model, workers=split.workers, threads=split.threads, kv_budget=worker_budget,
                              repack=repack, split_reason=split.reason) as cluster:
            err.write(f"embedded: {cluster.split}\n")
            run(connect(cluster.redis_url), cluster.check)
    if fmt == "csv":
        write_csv(output, extractions, schema)
    else:
        write_jsonl(output, extractions)
    report.extractions = extractions
    report.wall_seconds = time.monotonic() - t0
    err.write(f"done: {len(extractions) - report.failed} extracted, {report.failed} failed, {len(skipped)} skipped; "
              f"{report.wall_seconds:.1f} s\n")
    return report

"""rq task functions for `rqllm summarize`: map (one chunk) and reduce (combine partial summaries).

Both run inside an rqllm worker (jobs.runtime.get_context() gives the engine) and go through
jobs.runtime.run_current_job, so they stream tokens and record a JobResult in the ledger under their rq
job id, like any other job of a batch (the producer follows them through the batch's events).

* summarize_chunk(job, options): `job` is a GenerationJob payload whose messages are the map
  prompt around one chunk (built and token-counted by the producer, pipeline.summarize).
* reduce_summaries(spec, inputs, options): `spec` is a ReduceSpec payload (jobs.summary_unit), `inputs`
  the job ids of the summaries to combine, in document order (map jobs or lower-level reduce jobs).
  The reduce job is enqueued with `depends_on=inputs`, so rq starts it only when all of them
  finished; it reads their outcomes from the ledger, as the producer does, fills the prompt and
  generates.

What a job comes to (its summary, tokens and times) is jobs.summary_unit.ChunkSummary, computed from
the ledger's JobResult by whoever needs it; the tasks return only their job id.
"""
from __future__ import annotations

from typing import Any

from rq import get_current_job

from jobs import keys
from jobs.runtime import get_context, run_current_job
from jobs.schemas import GenerationJob, JobResult, TaskOptions
from jobs.summary_unit import ChunkSummary, ReduceSpec

__all__ = ["summarize_chunk", "reduce_summaries"]  # the tasks; the rest are helpers, not runnable by name


def _run(gjob: GenerationJob, options: dict[str, Any] | None) -> str:
    result: JobResult = run_current_job(gjob, TaskOptions.model_validate(options or {}))
    return result.job_id


def summarize_chunk(job: dict[str, Any], options: dict[str, Any] | None = None) -> str:
    """Map: summarise one chunk. `job` is the GenerationJob payload (map prompt messages)."""
    return _run(GenerationJob.model_validate(job), options)


def input_summaries(connection: Any, spec: ReduceSpec, inputs: list[str]) -> list[str]:
    """The non-empty summaries of the jobs `inputs`, in order, from their results in the ledger (a
    reduce input's copied part labels stripped, as the producer strips them)."""
    labels = spec.labels if spec.level > 1 else None
    raws = connection.mget([keys.result_key(j) for j in inputs])
    summaries: list[str] = []
    for job_id, raw in zip(inputs, raws):
        result = JobResult.model_validate_json(raw) if raw else None
        if result is None or result.status != "done":
            raise RuntimeError(f"input job {job_id} has no summary (missing, expired or not finished)")
        summary = ChunkSummary.from_result(result, labels=labels).summary
        if summary.strip():
            summaries.append(summary)
    if not summaries:
        raise RuntimeError(f"all {len(inputs)} input summaries are empty")
    return summaries


def reduce_summaries(spec: dict[str, Any], inputs: list[str], options: dict[str, Any] | None = None) -> str:
    """Reduce: combine the summaries of the jobs `inputs` (job ids, in document order). spec: a
    ReduceSpec payload (ReduceSpec.to_payload)."""
    reduce = ReduceSpec.from_payload(spec)
    rq_job = get_current_job()
    ctx = get_context()
    connection = rq_job.connection if rq_job is not None else ctx.connection
    summaries = input_summaries(connection, reduce, inputs)
    engine = ctx.engine
    capacity = getattr(engine, "kv_capacity", None)
    if capacity:
        def count(messages):
            return len(engine.tokenizer.encode(engine.render_chat(messages)))

        summaries = reduce.fit(summaries, count, capacity, int(reduce.params.get("max_tokens", 256)),
                               engine.tokenizer)
    gjob = GenerationJob(model=reduce.model, messages=reduce.messages(summaries), params=reduce.params,
                         metadata=dict(reduce.metadata))
    return _run(gjob, options)

"""rq task functions for `rqllm summarize`: map (one chunk) and reduce (combine partial summaries).

Both run inside an rqllm worker (jobs.runtime.get_context() gives the engine) and go through
jobs.runtime.run_current_job, so they stream tokens and record a JobResult in the ledger under their rq
job id, like any other job of a batch (the producer follows them through the batch's events).

* summarize_chunk(job, options): `job` is a GenerationJob payload whose messages are the map
  prompt around one chunk (built and token-counted by the producer, pipeline.summarize).
* reduce_summaries(spec, inputs, options): `inputs` are the rq job ids of the summaries to combine,
  in document order (map jobs or lower-level reduce jobs). The reduce job is enqueued with
  `depends_on=inputs`, so rq starts it only when all of them finished; it reads their return values
  at run time, fills the reduce template and generates.

Each returns a plain JSON dict (rq's JSONSerializer stores it as the job's return value):
    {"summary", "finish_reason", "prompt_tokens", "completion_tokens", "seconds",
     "prefix_hit_tokens", "draft_tokens", "accepted_tokens", "inputs", "generation_id", "worker"}
"""
from __future__ import annotations

import re
from typing import Any

from rq import get_current_job
from rq.job import Job

from engine.sentences import complete_end
from jobs.runtime import get_context, run_current_job
from jobs.schemas import GenerationJob, JobResult, TaskOptions

__all__ = ["summarize_chunk", "reduce_summaries"]  # the tasks; the rest are helpers, not runnable by name

# A lead-in label on the first line: "Summary:", "Here is a short summary of the text:", "The summary is:".
_LABEL = re.compile(r"^\s*(?:\*\*)?[^\n:]{0,40}?\bsummary\b[^\n:]{0,40}?(?:\*\*)?\s*:(?:\*\*)?\s*", re.I)
# Markdown images, linked or not ("[![Build status](badge.svg)](ci-url)", "![logo](logo.png)"): a model
# copies a README's badge lines into its summary, where they say nothing and leave it ending mid-line.
_IMAGE = re.compile(r"\[!\[[^\]\n]*\]\([^)\s]*\)\]\([^)\s]*\)|!\[[^\]\n]*\]\([^)\s]*\)")


def tidy_summary(text: str, finish_reason: str | None) -> str:
    """Strip a leading "Summary:" label and lines made only of Markdown images (badges); when the
    model ran out of tokens mid-sentence, end the summary at its last complete sentence or line
    (engine.sentences: CJK full stops, not after "e.g." or a list number), if that keeps at least
    a third of it."""
    out = _LABEL.sub("", text.strip(), count=1).strip()
    out = "\n".join(line for line in out.split("\n") if not _IMAGE.search(line) or _IMAGE.sub("", line).strip())
    out = re.sub(r"\n{3,}", "\n\n", out).strip()
    if finish_reason == "length":
        end = complete_end(out)
        if end and end >= len(out) // 3:
            out = out[:end]
    return out.strip()


def part_label_pattern(part: str) -> re.Pattern[str] | None:
    """A regex for the label the reduce template puts before each summary ("Part {n}: ").

    Small models copy that scaffolding into their answer; it is ours, so it is taken out again."""
    head = part.split("{summary}", 1)[0]
    if "{n}" not in head or not head.strip():
        return None
    pieces = [re.escape(x) for x in head.strip().split("{n}")]
    return re.compile(r"(?m)^[ \t]*" + r"\d+".join(pieces) + r"[ \t]*")


def _run(gjob: GenerationJob, options: dict[str, Any] | None, inputs: int,
         labels: re.Pattern[str] | None = None) -> dict[str, Any]:
    result: JobResult = run_current_job(gjob, TaskOptions.model_validate(options or {}))
    return summary_record(result, inputs=inputs, labels=labels)


def summary_record(result: JobResult, *, inputs: int, labels: re.Pattern[str] | None = None) -> dict[str, Any]:
    """What a map or reduce job returns, from its recorded outcome: the producer rebuilds the same
    record from the ledger's JobResult (pipeline.summarize.follow), so it needs no rq return value."""
    text = labels.sub("", result.text) if labels is not None else result.text
    return {
        "summary": tidy_summary(text, result.finish_reason),
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "seconds": round(result.prefill_seconds + result.decode_seconds, 4),
        "prefix_hit_tokens": result.prefix_hit_tokens,
        "draft_tokens": result.draft_tokens,
        "accepted_tokens": result.accepted_tokens,
        "inputs": inputs,
        "generation_id": result.job_id,
        "worker": result.worker,
    }


def summarize_chunk(job: dict[str, Any], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Map: summarise one chunk. `job` is the GenerationJob payload (map prompt messages)."""
    return _run(GenerationJob.model_validate(job), options, inputs=1)


def reduce_messages(spec: dict[str, Any], summaries: list[str]) -> list[dict[str, str]]:
    """The reduce prompt for `summaries` (in order), from the template strings in `spec`."""
    parts = [
        spec["part"].replace("{n}", str(i)).replace("{summary}", s.strip())
        for i, s in enumerate(summaries, 1)
    ]
    words = str(spec["words"])
    user = spec["user"].replace("{words}", words).replace("{text}", spec["separator"].join(parts))
    messages = []
    if spec.get("system"):
        messages.append({"role": "system", "content": spec["system"].replace("{words}", words)})
    messages.append({"role": "user", "content": user})
    return messages


def fit_summaries(spec: dict[str, Any], summaries: list[str], count_tokens, capacity: int,
                  max_tokens: int, tokenizer) -> list[str]:
    """Shorten the longest summaries (by tokens) until the reduce prompt + reply fits `capacity`.

    The producer sizes reduce groups from the upper bound max_summary_tokens per input, so this
    only matters if re-tokenising generated text comes out longer than it was generated.
    """
    summaries = list(summaries)
    for _ in range(10 * len(summaries) + 10):
        over = count_tokens(reduce_messages(spec, summaries)) + max_tokens - capacity
        if over <= 0:
            return summaries
        ids = [tokenizer.encode(s) for s in summaries]
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        keep = max(0, len(ids[longest]) - over - 1)
        summaries[longest] = tokenizer.decode(ids[longest][:keep]).rstrip()
        if keep == 0 and all(not s for s in summaries):
            break
    return summaries


def reduce_summaries(spec: dict[str, Any], inputs: list[str], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reduce: combine the summaries returned by the jobs `inputs` (rq ids, in document order).

    spec: {"model", "system", "user", "part", "separator", "words", "params" (SamplingParams dict),
           "metadata" (optional dict)}
    """
    rq_job = get_current_job()
    ctx = get_context()
    connection = rq_job.connection if rq_job is not None else ctx.connection
    serializer = rq_job.serializer if rq_job is not None else None
    summaries: list[str] = []
    for job, job_id in zip(Job.fetch_many(inputs, connection=connection, serializer=serializer), inputs):
        value = job.return_value() if job is not None else None
        if not isinstance(value, dict) or "summary" not in value:
            raise RuntimeError(f"input job {job_id} has no summary (missing, expired or not finished)")
        if value["summary"].strip():
            summaries.append(value["summary"])
    if not summaries:
        raise RuntimeError(f"all {len(inputs)} input summaries are empty")

    params = dict(spec.get("params") or {})
    engine = ctx.engine
    capacity = getattr(engine, "kv_capacity", None)
    if capacity:
        def count(messages):
            return len(engine.tokenizer.encode(engine.render_chat(messages)))

        summaries = fit_summaries(spec, summaries, count, capacity, int(params.get("max_tokens", 256)),
                                  engine.tokenizer)
    gjob = GenerationJob(model=spec["model"], messages=reduce_messages(spec, summaries), params=params,
                         metadata=dict(spec.get("metadata") or {}))
    return _run(gjob, options, inputs=len(inputs), labels=part_label_pattern(spec["part"]))

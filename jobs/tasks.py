"""rq task functions, referenced by dotted path (jobs.tasks.generate). Only allowlisted names run.

Arguments are plain JSON (rq's JSONSerializer): the job as a dict and the TaskOptions as a dict.
The return value (the JobResult as a dict) is stored by rq as JSON too; rqllm's own record is the
result key written atomically with the batch announcements (jobs.ledger).
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from rq import get_current_job

from jobs.ledger import Ledger
from jobs.runtime import DEFAULT_RESULT_TTL, DEFAULT_STREAM_TTL, TaskFailed, TaskOptions, run_generation
from jobs.schemas import GenerationJob, JobResult, describe_errors

log = logging.getLogger("rqllm.tasks")

__all__ = ["generate", "on_failure"]


def _retries_left(rq_job: Any) -> bool:
    return bool(rq_job is not None and rq_job.retries_left and rq_job.retries_left > 0)


def generate(job: dict[str, Any], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one GenerationJob with the worker's engine; returns its JobResult as a dict."""
    rq_job = get_current_job()
    opts = TaskOptions.model_validate(options or {})
    try:
        gjob = GenerationJob.model_validate(job)
    except ValidationError as e:
        from jobs.runtime import get_context

        ctx = get_context()
        job_id = rq_job.id if rq_job is not None else str(job.get("id", "?"))
        result = JobResult.failed(job_id, "invalid_request", describe_errors(e), worker=ctx.worker_name)
        ctx.ledger.finish(result, result_ttl=opts.result_ttl, stream_ttl=opts.stream_ttl)
        if rq_job is not None:
            rq_job.retries_left = 0
        raise TaskFailed(result) from None
    if rq_job is not None and rq_job.id != gjob.id:
        raise ValueError(f"rq job id {rq_job.id} does not match the job's content id {gjob.id}")
    attempt = 1 + int(getattr(rq_job, "number_of_retries", 0) or 0)
    timeout = float(rq_job.timeout) if rq_job is not None and rq_job.timeout and rq_job.timeout > 0 else None
    try:
        result = run_generation(gjob, opts, attempt=attempt, timeout=timeout,
                                retryable=lambda: _retries_left(rq_job))
    except TaskFailed:
        # Recorded as final: rq must not retry it (e.g. a request the engine refuses).
        if rq_job is not None:
            rq_job.retries_left = 0
        raise
    return result.model_dump(mode="json")


def on_failure(job: Any, connection: Any, exc_type: Any = None, exc_value: Any = None, tb: Any = None) -> None:
    """rq failure callback: records a failure that happened outside run_generation (e.g. the worker died
    and rq's cleanup found the job abandoned). Idempotent: an outcome already recorded is kept."""
    if _retries_left(job):
        return  # rq runs it again
    if isinstance(exc_type, type) and issubclass(exc_type, TaskFailed):
        # The task recorded this outcome itself. Recording it "if absent" again is not harmless: a producer
        # may have cleared that failed result meanwhile to run the job again (jobs.ledger's claim).
        return
    name = getattr(exc_type, "__name__", None) or type(exc_value).__name__
    if name == "AbandonedJobError":
        code, message = "worker_lost", "the worker running this job stopped responding (abandoned job)"
    elif name == "JobInterrupted":
        code, message = "stopped", "stopped on request (rq stop-job command)"
    else:
        code, message = "worker_error", f"{name}: {exc_value}"
    record_rq_failure(connection, job, code, message)


def record_rq_failure(connection: Any, rq_job: Any, code: str, message: str) -> int:
    """record_failure() for an rq Job, taking model and TTLs from its arguments when decodable."""
    payload: Any = None
    options: Any = None
    try:
        args = rq_job.args or ()
        kwargs = rq_job.kwargs or {}
        payload = args[0] if args else kwargs.get("job")
        options = args[1] if len(args) > 1 else kwargs.get("options")
    except Exception:  # noqa: BLE001 - an undecodable job still gets its failure recorded
        pass
    return record_failure(connection, rq_job.id, code, message, payload=payload, options=options,
                          worker=getattr(rq_job, "worker_name", None) or None)


def record_failure(connection: Any, job_id: str, code: str, message: str, *, payload: Any = None,
                   options: Any = None, worker: str | None = None) -> int:
    """Record a failed outcome unless one is already recorded; tells the waiting batches.
    Returns how many batches were told, or -1 when an outcome was already there."""
    payload = payload if isinstance(payload, dict) else {}
    options = options if isinstance(options, dict) else {}
    result = JobResult.failed(
        job_id, code, message,
        model=str(payload.get("model", "")),
        endpoint="/v1/chat/completions" if "messages" in payload else "/v1/completions",
        worker=worker,
    )
    told = Ledger(connection).finish(
        result,
        result_ttl=int(options.get("result_ttl", DEFAULT_RESULT_TTL)),
        stream_ttl=int(options.get("stream_ttl", DEFAULT_STREAM_TTL)),
        only_if_absent=True,
    )
    if told >= 0:
        log.warning("job %s recorded failed: %s: %s", job_id, code, message)
    return told

"""rq task functions, referenced by dotted path (jobs.tasks.generate). Only allowlisted names run.

Arguments are plain JSON (rq's JSONSerializer): the job as a dict and the TaskOptions as a dict.
The return value (the JobResult as a dict) is stored by rq as JSON too; rqllm's own record is the
result key written atomically with the batch announcements (jobs.ledger).
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from rq import get_current_job

from jobs.outcomes import mark_final, record_failure, record_rq_failure, retries_left
from jobs.runtime import TaskFailed, get_context, run_current_job
from jobs.schemas import GenerationJob, TaskOptions, describe_errors

__all__ = ["generate", "on_failure"]


def generate(job: dict[str, Any], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one GenerationJob with the worker's engine; returns its JobResult as a dict."""
    rq_job = get_current_job()
    opts = TaskOptions.model_validate(options or {})
    try:
        gjob = GenerationJob.model_validate(job)
    except ValidationError as e:
        ctx = get_context()
        job_id = rq_job.id if rq_job is not None else str(job.get("id", "?"))
        result, _ = record_failure(ctx.ledger, job_id, "invalid_request", describe_errors(e), options=opts,
                                   only_if_absent=False, worker=ctx.worker_name)
        mark_final(rq_job)
        raise TaskFailed(result) from None
    if rq_job is not None and rq_job.id != gjob.id:
        raise ValueError(f"rq job id {rq_job.id} does not match the job's content id {gjob.id}")
    return run_current_job(gjob, opts).model_dump(mode="json")


def on_failure(job: Any, connection: Any, exc_type: Any = None, exc_value: Any = None, tb: Any = None) -> None:
    """rq failure callback: records a failure that happened outside run_generation (e.g. the worker died
    and rq's cleanup found the job abandoned). Idempotent: an outcome already recorded is kept."""
    if retries_left(job):
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

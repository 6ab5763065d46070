"""A job's failed outcome: the one place that builds a failed JobResult and records it in the ledger.

Whoever decides a job failed calls record_failure(): the task itself (jobs.runtime: a refused request,
a timeout, an engine error), rq's failure callback (jobs.tasks.on_failure: an abandoned job), the
worker (a job rq failed outside the task: refused, stopped), the producer's reconciliation
(pipeline.client: a job deleted or expired) and cancellation (pipeline.cancel). Attempt and retry
rules live beside it (retries_left, mark_final): they decide whether a failure is final.
"""
from __future__ import annotations

import logging
from typing import Any

from jobs.ledger import Ledger
from jobs.schemas import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, JobResult, TaskOptions
from jobs.streams import DEFAULT_STREAM_MAXLEN

log = logging.getLogger("rqllm.tasks")


# ------------------------------------------------------------ attempts and retries (rq's counters)
def retries_left(rq_job: Any) -> bool:
    """Whether rq will run the job again after this run fails."""
    return bool(rq_job is not None and rq_job.retries_left and rq_job.retries_left > 0)


def mark_final(rq_job: Any) -> None:
    """The failure is recorded as final (e.g. a request the engine refuses): rq must not retry it."""
    if rq_job is not None:
        rq_job.retries_left = 0


def attempt_number(rq_job: Any) -> int:
    """This run's number as rq counts it (jobs.streams' start marker also counts runs lost with a worker)."""
    return 1 + int(getattr(rq_job, "number_of_retries", 0) or 0) if rq_job is not None else 1


def job_timeout(rq_job: Any) -> float | None:
    """The job's timeout in seconds (None: none); enforced between tokens, not by rq's SIGALRM."""
    return float(rq_job.timeout) if rq_job is not None and rq_job.timeout and rq_job.timeout > 0 else None


# ------------------------------------------------------------ recording a failure
def record_failure(ledger: Ledger, job_id: str, code: str, message: str, *, payload: Any = None,
                   options: TaskOptions | dict[str, Any] | None = None, only_if_absent: bool = True,
                   last_text: str = "", stream_maxlen: int = DEFAULT_STREAM_MAXLEN, client: Any = None,
                   **fields: Any) -> tuple[JobResult, int]:
    """Record a failed outcome and tell the waiting batches; returns the result and how many batches
    were told (-1: only_if_absent and an outcome was already there).

    payload: the job's GenerationJob payload when known (model and endpoint come from it); fields:
    more JobResult fields (worker, attempt, started_at...); client: a pipeline to queue the write on."""
    payload = payload if isinstance(payload, dict) else {}
    if not isinstance(options, TaskOptions):
        options = _options_or_default(options)
    fields.setdefault("model", str(payload.get("model", "")))
    fields.setdefault("endpoint", ENDPOINT_CHAT if "messages" in payload else ENDPOINT_COMPLETIONS)
    result = JobResult.failed(job_id, code, message, **fields)
    told = ledger.finish(result, result_ttl=options.result_ttl, stream_ttl=options.stream_ttl,
                         last_text=last_text, only_if_absent=only_if_absent, stream_maxlen=stream_maxlen,
                         client=client)
    if only_if_absent and client is None and told >= 0:
        log.warning("job %s recorded failed: %s: %s", job_id, code, message)
    return result, told


def rq_job_arguments(rq_job: Any) -> tuple[Any, Any]:
    """(payload, options) as an rq job of ours carries them, None where they cannot be decoded."""
    try:
        args = rq_job.args or ()
        kwargs = rq_job.kwargs or {}
        return (args[0] if args else kwargs.get("job"), args[1] if len(args) > 1 else kwargs.get("options"))
    except Exception:  # noqa: BLE001 - an undecodable job still gets its failure recorded
        return None, None


def record_rq_failure(connection: Any, rq_job: Any, code: str, message: str) -> int:
    """record_failure() for an rq Job, taking model and TTLs from its arguments when decodable."""
    payload, options = rq_job_arguments(rq_job)
    _, told = record_failure(Ledger(connection), rq_job.id, code, message, payload=payload, options=options,
                             worker=getattr(rq_job, "worker_name", None) or None)
    return told


def _options_or_default(options: Any) -> TaskOptions:
    options = options if isinstance(options, dict) else {}
    try:
        return TaskOptions(**{k: int(options[k]) for k in ("result_ttl", "stream_ttl") if k in options})
    except (TypeError, ValueError):
        return TaskOptions()

"""Cancel a job that nobody else waits for: a queued one never runs, a running one is stopped.

Jobs are content-addressed and shared: two batches (or a batch and an HTTP request) asking for the
same content wait for one job. Cancelling for one of them must not take the job from the others, so
`cancel_unwanted_job` acts only when the caller is the last one waiting, and decides that inside a
WATCH transaction on the job's waiting sets, rq hash and result: a batch that joins the job meanwhile
makes the transaction retry, and the job is then left alone. Only one owner's batches and requests
can share a job (GenerationJob.owner is part of its id), so no API key cancels another key's job.

A cancelled job is recorded failed with the caller's code and message, atomically with the decision
(jobs.ledger's finish: the waiting batch hears about it at once, its collector writes the line). A
running job is recorded the same way, then told to stop through rq's stop-job command (its worker
stops between two tokens; the worker's own "stopped" record is then a no-op, ours was first).
"""
from __future__ import annotations

from typing import Any, Literal

from redis import Redis
from redis.exceptions import WatchError
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job

from jobs import keys
from jobs.ledger import Ledger
from jobs.outcomes import record_failure
from jobs.defaults import ACTIVE_STATUSES, RESULT_TTL, STREAM_TTL, WAITING_STATUSES
from jobs.schemas import TaskOptions
from jobs.redis_conn import SERIALIZER

CancelOutcome = Literal["cancelled", "stopping", "shared", "ended", "gone"]


def _text(raw: Any) -> str | None:
    return raw.decode() if isinstance(raw, bytes) else raw


def _payload(connection: Redis, job_id: str) -> Any:
    try:
        return Job.fetch(job_id, connection=connection, serializer=SERIALIZER).args[0]
    except Exception:  # noqa: BLE001 - an undecodable job is still cancelled, with less detail
        return None


def cancel_unwanted_job(connection: Redis, job_id: str, *, code: str, message: str, batch_id: str = "",
                        result_ttl: int = RESULT_TTL, stream_ttl: int = STREAM_TTL) -> CancelOutcome:
    """Cancel `job_id` on behalf of `batch_id` ('' = an HTTP request that has already left the job's
    waiters set), unless someone else still waits for it.

    Returns "cancelled" (was queued: removed from its queue, recorded failed), "stopping" (was running:
    recorded failed, its worker told to stop), "shared" (another batch or request waits: left alone),
    "ended" (it already has an outcome) or "gone" (rq no longer has it and it has no outcome)."""
    ledger = Ledger(connection)
    job_key = Job.key_for(job_id)
    waiting_key, waiters_key, result_key = (keys.job_batches_key(job_id), keys.api_waiters_key(job_id),
                                            keys.result_key(job_id))
    with connection.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(waiting_key, waiters_key, job_key, result_key)
                if pipe.exists(result_key):
                    return "ended"
                others = {_text(b) for b in pipe.smembers(waiting_key)} - {batch_id}
                if others or pipe.scard(waiters_key):
                    return "shared"
                status = _text(pipe.hget(job_key, "status"))
                if status not in ACTIVE_STATUSES:
                    return "gone" if status is None else "ended"
                payload = _payload(connection, job_id)
                waiting = status in WAITING_STATUSES
                rq_job = Job.fetch(job_id, connection=connection, serializer=SERIALIZER) if waiting else None
                pipe.multi()
                if rq_job is not None:
                    rq_job.cancel(pipeline=pipe)
                record_failure(ledger, job_id, code, message, payload=payload, client=pipe,
                               options=TaskOptions(result_ttl=result_ttl, stream_ttl=stream_ttl))
                pipe.execute()
            except WatchError:
                continue
            except NoSuchJobError:
                return "gone"
            break
    if status in WAITING_STATUSES:
        return "cancelled"
    try:
        send_stop_job_command(connection, job_id, serializer=SERIALIZER)
    except (InvalidJobOperation, NoSuchJobError):
        return "ended"  # it ended between our record and the command
    return "stopping"

"""The one enqueue path (used through pipeline.client.Client): record a batch, claim each job in the
ledger, enqueue what must run into rq, ring the model's doorbell.

A TaskCall is one rq job: jobs.tasks.generate for a GenerationJob (Client.submit_batch), or the
summariser's map and reduce tasks (pipeline.summarize.run), whose reduce jobs wait for their inputs
through rq's dependencies. Whatever the task, its outcome is recorded in the ledger under the rq job
id, which the batch waits for, so the collector, `rqllm status` and the summariser follow every batch
the same way (its events stream).
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from rq import Callback, Queue, Retry
from rq.job import Dependency

from jobs import keys
from jobs.defaults import JOB_TIMEOUT
from jobs.keys import dumps
from jobs.ledger import Ledger
from jobs.redis_conn import SERIALIZER
from jobs.schemas import TaskOptions, model_key, queue_name
from jobs.streams import append_entry

TASK_ON_FAILURE = "jobs.tasks.on_failure"
DOORBELL_TOKENS = 64  # at most this many idle workers woken per submission
_CHUNK = 1000


@dataclass
class TaskCall:
    job_id: str  # the rq job id, and the id its outcome is recorded under
    model: str
    func: str  # an allowlisted task (jobs.allowlist); it is called with `args` + (the TaskOptions dict,)
    args: tuple[Any, ...]
    description: str
    custom_id: str | None = None
    depends_on: list[str] | None = None  # rq job ids that must finish first; it then goes to the queue's front


def create_batch(connection: Redis, batch_id: str, *, entries: Sequence[tuple[str | None, str]], total: int,
                 models: Sequence[str], priority: str, metadata: dict[str, Any] | None, ttl: int,
                 refused: Sequence[dict[str, Any]] = ()) -> None:
    """The batch's hash, its (custom_id, job_id) entries, its events stream (opened by a "created" event)
    and its place in the index; `refused`: the input lines refused at submission (jobs.keys.batch_refused_key).
    Raises ValueError when the batch exists."""
    created = time.time()
    bkey = keys.batch_key(batch_id)
    if connection.exists(bkey):
        raise ValueError(f"batch {batch_id} already exists")
    with connection.pipeline(transaction=True) as p:
        p.hset(bkey, mapping={
            "created": dumps(created), "total": total, "requests": len(entries), "done": 0, "failed": 0,
            "cached": 0, "models": dumps(sorted({model_key(m) for m in models})), "priority": dumps(priority),
            "metadata": dumps(metadata or {}), "refused": len(refused),
        })
        p.expire(bkey, ttl)
        _add_entries(p, batch_id, entries, ttl)
        if refused:
            rkey = keys.batch_refused_key(batch_id)
            rows = [dumps(r) for r in refused]
            for i in range(0, len(rows), _CHUNK):
                p.rpush(rkey, *rows[i:i + _CHUNK])
            p.expire(rkey, ttl)
        evkey = keys.batch_events_key(batch_id)
        append_entry(p, evkey, {"type": "created", "total": total})
        p.expire(evkey, ttl)
        p.zadd(keys.BATCHES_INDEX, {batch_id: created})
        p.execute()


def extend_batch(connection: Redis, batch_id: str, *, entries: Sequence[tuple[str | None, str]], models: Sequence[str],
                 ttl: int) -> None:
    """More jobs for a batch already created (a producer that plans as it submits)."""
    bkey = keys.batch_key(batch_id)
    with connection.pipeline(transaction=True) as p:
        p.hincrby(bkey, "total", len({jid for _, jid in entries}))
        p.hincrby(bkey, "requests", len(entries))
        p.hget(bkey, "models")
        reply = p.execute()
    known = set(_json_list(reply[2]))
    with connection.pipeline(transaction=True) as p:
        p.hset(bkey, "models", dumps(sorted(known | {model_key(m) for m in models})))
        _add_entries(p, batch_id, entries, ttl)
        p.execute()


def _json_list(raw: Any) -> list[str]:
    try:
        value = json.loads(raw) if raw else []
    except (TypeError, ValueError):
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def _add_entries(pipe: Any, batch_id: str, entries: Sequence[tuple[str | None, str]], ttl: int) -> None:
    ekey = keys.batch_entries_key(batch_id)
    rows = [dumps([cid, jid]) for cid, jid in entries]
    for i in range(0, len(rows), _CHUNK):
        pipe.rpush(ekey, *rows[i:i + _CHUNK])
    pipe.expire(ekey, ttl)


def claim_and_enqueue(connection: Redis, ledger: Ledger, options: TaskOptions, batch_id: str,
                      calls: Sequence[TaskCall], *, priority: str, timeout: int | None, retries: int,
                      recompute: bool) -> tuple[list[TaskCall], list[str]]:
    """Claim every call for the batch ('' = none) and enqueue those whose claim says so; returns the
    calls enqueued and every claim's reply ('cached', 'joined' or 'enqueue'), in order."""
    waiting_ttl = max(options.result_ttl, options.stream_ttl)
    replies: list[Any] = []
    for i in range(0, len(calls), _CHUNK):
        with connection.pipeline(transaction=False) as p:
            for c in calls[i:i + _CHUNK]:
                ledger.claim(p, batch_id, c.job_id, recompute=recompute, waiting_ttl=waiting_ttl)
            replies.extend(p.execute())
    replies = [r.decode() if isinstance(r, bytes) else r for r in replies]
    to_enqueue = [c for c, r in zip(calls, replies) if r == "enqueue"]
    opts = options.model_dump()

    def job_options(c: TaskCall) -> dict[str, Any]:
        return dict(timeout=timeout or JOB_TIMEOUT, result_ttl=options.result_ttl,
                    failure_ttl=options.result_ttl, description=c.description, job_id=c.job_id,
                    meta={"batch_id": batch_id, "custom_id": c.custom_id},
                    retry=Retry(max=retries) if retries > 0 else None, on_failure=Callback(TASK_ON_FAILURE))

    by_queue: dict[str, list[Any]] = {}
    for c in to_enqueue:
        if not c.depends_on:
            by_queue.setdefault(queue_name(c.model, priority), []).append(
                Queue.prepare_data(c.func, args=(*c.args, opts), **job_options(c)))
    for qname, datas in by_queue.items():
        q = Queue(qname, connection=connection, serializer=SERIALIZER)
        for i in range(0, len(datas), _CHUNK):
            with connection.pipeline(transaction=True) as p:
                q.enqueue_many(datas[i:i + _CHUNK], pipeline=p)
                p.execute()
    for c in to_enqueue:
        if c.depends_on:
            # enqueue_at_front: a job whose inputs are done goes ahead of the jobs still queued (the
            # summariser's documents then finish one after another, not all at the end).
            q = Queue(queue_name(c.model, priority), connection=connection, serializer=SERIALIZER)
            q.enqueue_call(c.func, args=(*c.args, opts), depends_on=Dependency(jobs=list(c.depends_on),
                                                                                enqueue_at_front=True),
                           **job_options(c))
    ring_doorbells(connection, {c.model for c in to_enqueue}, len(to_enqueue))
    return to_enqueue, replies


def ring_doorbells(connection: Redis, models: set[str], jobs: int) -> None:
    """Wake idle workers of these models now rather than at their next poll (a hint: a lost token
    loses nothing)."""
    if not models or jobs <= 0:
        return
    with connection.pipeline(transaction=False) as p:
        n = min(jobs, DOORBELL_TOKENS)
        for m in sorted({model_key(m) for m in models}):
            k = keys.doorbell_key(m)
            p.rpush(k, *(["1"] * n))
            p.ltrim(k, -256, -1)
            p.expire(k, 3600)
        p.execute()

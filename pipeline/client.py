"""Producer side: submit jobs and batches into rq (JSON only), read batch status and results.

    client = Client("redis://127.0.0.1:6379/0")
    batch_id = client.submit_batch([GenerationJob(model="smollm2-135m", prompt="Hi", custom_id="a")])
    client.batch_status(batch_id)      # BatchStatus(total=1, done=0, failed=0, ...)
    client.results(batch_id)           # [(custom_id, JobResult | None), ...]

Keys: see jobs.keys. Queues: rq queues `rqllm:<model>:<high|default|low>` with rq's standard keys
(rq:queue:<name>, rq:job:<id>, registries), so `rq info` and rq-dashboard see them.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel
from redis import Redis
from rq import Queue
from rq.job import Job

from jobs import keys
from jobs.ledger import Ledger
from jobs.outcomes import record_failure, record_rq_failure
from jobs.redis_conn import SERIALIZER, connect
from jobs.defaults import ACTIVE_STATUSES, DEFAULT_PRIORITY, PRIORITIES, RESULT_TTL, STREAM_TTL
from jobs.schemas import (GenerationJob, InvalidJob, JobResult,
                          TaskOptions, queue_name, validate_job)
from jobs.streams import StreamEntry, read_stream
from pipeline.batch_file import Refused
from pipeline.enqueue import TaskCall, claim_and_enqueue, create_batch, extend_batch

TASK_GENERATE = "jobs.tasks.generate"
_CHUNK = 1000


class BatchStatus(BaseModel):
    batch_id: str
    created: float
    total: int  # distinct jobs (requests with the same content share one job)
    requests: int  # lines (custom_ids)
    done: int
    failed: int
    cached: int
    models: list[str]
    priority: str
    metadata: dict[str, Any] = {}
    refused: int = 0  # input lines refused at submission (in the batch's results as error lines)
    cancelled: float | None = None  # when `rqllm cancel` cancelled it

    @property
    def lines(self) -> int:
        """Every input line, the refused ones too (the API's request_counts.total)."""
        return self.requests + self.refused

    @property
    def ended(self) -> int:
        return self.done + self.failed

    @property
    def pending(self) -> int:
        return max(0, self.total - self.ended)

    @property
    def finished(self) -> bool:
        return self.ended >= self.total


class SubmitReport(BaseModel):
    batch_id: str
    total: int
    requests: int
    enqueued: int
    joined: int
    cached: int


def _j(raw: Any) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return raw.decode() if isinstance(raw, bytes) else raw


class Client:
    def __init__(
        self,
        redis_url: str | None = None,
        *,
        connection: Redis | None = None,
        result_ttl: int = RESULT_TTL,
        stream_ttl: int = STREAM_TTL,
    ):
        self.connection = connection if connection is not None else connect(redis_url)
        self.options = TaskOptions(result_ttl=result_ttl, stream_ttl=stream_ttl)
        self.ledger = Ledger(self.connection)
        self.last_report: SubmitReport | None = None
        self._ttl = max(self.options.result_ttl, self.options.stream_ttl)  # of a batch's keys

    # ---------------------------------------------------------------- queues
    def queue(self, model: str, priority: str = DEFAULT_PRIORITY) -> Queue:
        return Queue(queue_name(model, priority), connection=self.connection, serializer=SERIALIZER)

    # ---------------------------------------------------------------- submit
    def submit(self, job: GenerationJob | dict[str, Any], *, priority: str = DEFAULT_PRIORITY,
               timeout: int | None = None, retries: int = 0, recompute: bool = False) -> str:
        """Submit one job outside any batch; returns its (content-derived) id. See wait()/result()."""
        gjob = validate_job(job)
        self._claim_and_enqueue("", [gjob], priority=priority, timeout=timeout, retries=retries,
                                recompute=recompute)
        return gjob.id

    def submit_batch(
        self,
        jobs: Iterable[GenerationJob | dict[str, Any]],
        *,
        priority: str = DEFAULT_PRIORITY,
        timeout: int | None = None,
        retries: int = 0,
        recompute: bool = False,
        batch_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        owner: str | None = None,
        refused: Sequence[Refused] = (),
    ) -> str:
        """Validate every job (InvalidJob names the bad ones, nothing is submitted then), record the batch,
        reuse finished results, enqueue the rest. Returns the batch id.
        owner: set on every job (GenerationJob.owner: the API key's owner id); a job naming another is refused.
        refused: the input lines the producer refused: kept with the batch, so its results hold an error line
        for each and its counts include them (as the API's request_counts do)."""
        if priority not in PRIORITIES:
            raise InvalidJob(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
        if retries < 0:
            raise InvalidJob("retries must be >= 0")
        parsed: list[GenerationJob] = []
        errors: list[str] = []
        for i, raw in enumerate(jobs):
            try:
                gjob = validate_job(raw)
            except InvalidJob as e:
                cid = raw.get("custom_id") if isinstance(raw, dict) else getattr(raw, "custom_id", None)
                errors.append(f"job {i + 1}" + (f" ({cid})" if cid else "") + f": {e}")
                continue
            if owner is not None and gjob.owner != owner:
                if gjob.owner is not None:
                    errors.append(f"job {i + 1}: owner {gjob.owner!r} is not this batch's owner")
                    continue
                gjob = validate_job({**gjob.model_dump(exclude={"id"}), "owner": owner})  # the id includes it
            if gjob.custom_id is None:
                # Re-derive the id: a sampled job without a seed is keyed by its custom_id too.
                gjob = validate_job({**gjob.model_dump(exclude={"id"}), "custom_id": f"request-{i + 1}"})
            parsed.append(gjob)
        seen: set[str] = set()
        for g in parsed:
            if g.custom_id in seen:
                errors.append(f"custom_id {g.custom_id!r} appears more than once")
            seen.add(g.custom_id)
        if errors:
            raise InvalidJob("\n".join(errors))
        if not parsed:
            raise InvalidJob("a batch needs at least one job")

        batch_id = batch_id or "batch_" + uuid.uuid4().hex[:24]
        for g in parsed:
            if g.batch_id is None:
                g.batch_id = batch_id
        unique: dict[str, GenerationJob] = {}
        for g in parsed:
            unique.setdefault(g.id, g)
        try:
            create_batch(self.connection, batch_id, entries=[(g.custom_id, g.id) for g in parsed], total=len(unique),
                         models=[g.model for g in parsed], priority=priority, metadata=metadata, ttl=self._ttl,
                         refused=[r.as_dict() for r in refused])
        except ValueError as e:
            raise InvalidJob(str(e)) from None
        self._claim_and_enqueue(batch_id, list(unique.values()), priority=priority, timeout=timeout,
                                retries=retries, recompute=recompute, requests=len(parsed))
        return batch_id

    def _claim_and_enqueue(self, batch_id: str, jobs: Sequence[GenerationJob], *, priority: str,
                           timeout: int | None, retries: int, recompute: bool, requests: int = 1) -> SubmitReport:
        calls = [TaskCall(g.id, g.model, TASK_GENERATE, (g.to_payload(),),
                          f"generate {g.custom_id or g.id} ({batch_id or 'no batch'})", custom_id=g.custom_id)
                 for g in jobs]
        report = self.submit_calls(batch_id, calls, priority=priority, timeout=timeout, retries=retries,
                                   recompute=recompute)
        report.requests = requests
        return report

    def open_batch(self, batch_id: str, *, priority: str = DEFAULT_PRIORITY,
                   metadata: dict[str, Any] | None = None) -> str:
        """An empty batch that submit_calls(..., extend=True) fills (a producer that plans as it submits)."""
        create_batch(self.connection, batch_id, entries=[], total=0, models=[], priority=priority,
                     metadata=metadata, ttl=self._ttl)
        return batch_id

    def submit_calls(self, batch_id: str, calls: Sequence[TaskCall], *, priority: str = DEFAULT_PRIORITY,
                     timeout: int | None = None, retries: int = 0, recompute: bool = False,
                     extend: bool = False) -> SubmitReport:
        """Claim and enqueue rq jobs of any allowlisted task for a batch ('' = none); extend=True adds
        them to the batch's entries and total first (each call's custom_id, else its job id)."""
        if extend:
            extend_batch(self.connection, batch_id, entries=[(c.custom_id or c.job_id, c.job_id) for c in calls],
                         models=[c.model for c in calls], ttl=self._ttl)
        enqueued, replies = claim_and_enqueue(self.connection, self.ledger, self.options, batch_id, calls,
                                              priority=priority, timeout=timeout, retries=retries,
                                              recompute=recompute)
        report = SubmitReport(
            batch_id=batch_id, total=len(calls), requests=len(calls), enqueued=len(enqueued),
            joined=sum(r == "joined" for r in replies), cached=sum(r == "cached" for r in replies),
        )
        self.last_report = report
        return report

    # ---------------------------------------------------------------- read
    def batch_status(self, batch_id: str) -> BatchStatus:
        raw = self.connection.hgetall(keys.batch_key(batch_id))
        if not raw:
            raise KeyError(f"no such batch: {batch_id}")
        d = {k.decode(): _j(v) for k, v in raw.items()}
        return BatchStatus(
            batch_id=batch_id, created=float(d.get("created", 0)), total=int(d.get("total", 0)),
            requests=int(d.get("requests", 0)), done=int(d.get("done", 0)), failed=int(d.get("failed", 0)),
            cached=int(d.get("cached", 0)), models=list(d.get("models") or []),
            priority=str(d.get("priority", DEFAULT_PRIORITY)), metadata=d.get("metadata") or {},
            refused=int(d.get("refused") or 0), cancelled=d.get("cancelled"),
        )

    def batch_entries(self, batch_id: str) -> list[tuple[str, str]]:
        """(custom_id, job_id) per request line, in submission order."""
        raw = self.connection.lrange(keys.batch_entries_key(batch_id), 0, -1)
        return [tuple(json.loads(r)) for r in raw]  # type: ignore[misc]

    def result(self, job_id: str) -> JobResult | None:
        raw = self.connection.get(keys.result_key(job_id))
        return JobResult.model_validate_json(raw) if raw else None

    def results_for(self, job_ids: Sequence[str]) -> dict[str, JobResult]:
        out: dict[str, JobResult] = {}
        ids = list(job_ids)
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i:i + _CHUNK]
            for jid, raw in zip(chunk, self.connection.mget([keys.result_key(j) for j in chunk])):
                if raw:
                    out[jid] = JobResult.model_validate_json(raw)
        return out

    def results(self, batch_id: str) -> list[tuple[str, JobResult | None]]:
        entries = self.batch_entries(batch_id)
        found = self.results_for(sorted({jid for _, jid in entries}))
        return [(cid, found.get(jid)) for cid, jid in entries]

    def events(self, batch_id: str, last_id: str = "0", *, block_ms: int | None = None,
               count: int | None = 1000) -> list[StreamEntry]:
        return read_stream(self.connection, keys.batch_events_key(batch_id), last_id, block_ms=block_ms, count=count)

    def wait(self, job_id: str, timeout: float | None = None, poll: float = 0.5) -> JobResult:
        """Block until the job has an outcome; raises TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tkey = keys.token_stream_key(job_id)
        last = "$"
        while True:
            res = self.result(job_id)
            if res is not None:
                return res
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} has no outcome after {timeout} s")
            entries = read_stream(self.connection, tkey, last, block_ms=int(poll * 1000))
            if entries:
                last = entries[-1].id

    def job_status(self, job_id: str) -> str | None:
        s = self.connection.hget(Job.key_for(job_id), "status")
        return s.decode() if s else None

    def reconcile(self, batch_id: str, pending: Iterable[str] | None = None, grace: float = 1.0) -> int:
        """Record failures for pending jobs of a batch that can no longer end by themselves (the rq job
        was deleted, expired, canceled or failed without an outcome recorded). Returns how many."""

        if pending is None:
            ids = sorted({jid for _, jid in self.batch_entries(batch_id)})
            have = self.results_for(ids)
            pending = [j for j in ids if j not in have]
        pending = list(pending)
        if not pending:
            return 0

        def probe(ids: list[str]) -> dict[str, tuple[bool, str | None]]:
            with self.connection.pipeline(transaction=False) as p:
                for j in ids:
                    p.exists(keys.result_key(j))
                    p.hget(Job.key_for(j), "status")
                r = p.execute()
            return {j: (bool(r[2 * i]), r[2 * i + 1].decode() if r[2 * i + 1] else None) for i, j in enumerate(ids)}

        state = probe(pending)
        suspects = [j for j, (has, st) in state.items() if not has and st not in ACTIVE_STATUSES]
        if not suspects:
            return 0
        time.sleep(grace)  # a concurrent submitter may be between its claim and its enqueue
        state = probe(suspects)
        fixed = 0
        for j, (has, st) in state.items():
            if has or st in ACTIVE_STATUSES:
                continue
            if st is None:
                _, told = record_failure(self.ledger, j, "lost",
                                         "the job is no longer in Redis (deleted or expired) and has no result")
            else:
                try:
                    rq_job = Job.fetch(j, connection=self.connection, serializer=SERIALIZER)
                    latest = rq_job.latest_result()
                    why = (latest.exc_string or "").strip().splitlines()[-1:] if latest else []
                except Exception:  # noqa: BLE001
                    rq_job, why = None, []
                code = {"canceled": "canceled", "stopped": "stopped"}.get(st, "worker_error")
                message = f"rq marked the job {st}" + (f": {why[0]}" if why else "")
                if rq_job is not None:
                    told = record_rq_failure(self.connection, rq_job, code, message)
                else:
                    _, told = record_failure(self.ledger, j, code, message)
            fixed += told >= 0
        return fixed

    # ---------------------------------------------------------------- overview
    def list_batches(self, limit: int = 20) -> list[BatchStatus]:
        ids = [b.decode() for b in self.connection.zrevrange(keys.BATCHES_INDEX, 0, max(0, limit - 1))]
        out = []
        for b in ids:
            try:
                out.append(self.batch_status(b))
            except KeyError:
                self.connection.zrem(keys.BATCHES_INDEX, b)
        return out

    def queues(self) -> list[Queue]:
        qs = Queue.all(connection=self.connection, serializer=SERIALIZER)
        return sorted((q for q in qs if q.name.startswith(keys.QUEUE_NAME_PREFIX)), key=lambda q: q.name)

    def workers(self) -> list[dict[str, Any]]:
        from rq import SimpleWorker

        out = []
        for w in SimpleWorker.all(connection=self.connection, serializer=SERIALIZER):
            model, kv_tokens = self.connection.hmget(w.key, ["rqllm_model", "rqllm_kv_tokens"])
            try:
                current = w.get_current_job_id()
            except Exception:  # noqa: BLE001
                current = None
            out.append({
                "name": w.name,
                "state": w.get_state(),
                "model": model.decode() if model else None,
                "kv_tokens": int(kv_tokens) if kv_tokens and kv_tokens.isdigit() else None,  # its KV capacity
                "queues": w.queue_names(),
                "current_job": current,
                "pid": w.pid,
                "hostname": w.hostname,
                "successful": w.successful_job_count,
                "failed": w.failed_job_count,
            })
        return out

    def ping(self) -> bool:
        return bool(self.connection.ping())


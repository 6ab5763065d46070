"""A batch as its user sees it: input lines (refused ones included), each line's job and state, and
cancelling what has not ended. `rqllm status`, `rqllm jobs`, `rqllm cancel` and the collector read it here.

The batch's own counters (pipeline.client.BatchStatus) count jobs, and lines with the same content share
one job; the API's request_counts count lines, refused ones too. LineCounts is the API's view.
"""
from __future__ import annotations

import json
import time

from pydantic import BaseModel
from redis import Redis
from rq.job import Job

from jobs import keys
from pipeline.batch_file import Refused
from pipeline.client import BatchStatus, Client

_CHUNK = 1000


class LineCounts(BaseModel):
    """A batch's input lines as the API counts them (request_counts): every line, refused ones included."""
    lines: int
    done: int
    failed: int  # refused at submission, or failed in a worker
    refused: int

    @property
    def pending(self) -> int:
        return max(0, self.lines - self.done - self.failed)


class JobState(BaseModel):
    """One input line of a batch and where its job stands (`rqllm jobs`)."""
    custom_id: str | None
    job_id: str | None  # None for a line refused at submission
    state: str  # done, failed, refused, or rq's status while it has no outcome (queued, started, deferred ...)
    error: str | None = None  # code: message, for failed and refused lines


def refused_lines(connection: Redis, batch_id: str) -> list[Refused]:
    """The input lines refused at submission (Client.submit_batch's `refused`), in input order."""
    return [Refused.from_dict(json.loads(r)) for r in connection.lrange(keys.batch_refused_key(batch_id), 0, -1)]


def line_counts(client: Client, status: BatchStatus) -> LineCounts:
    """The batch's lines as the API counts them. With one line per job the job counters count lines;
    otherwise each line's job is looked up (one read per line)."""
    if status.requests == status.total:
        done, failed = status.done, status.failed
    else:
        entries = client.batch_entries(status.batch_id)
        found = client.results_for(sorted({jid for _, jid in entries}))
        outcomes = [found[jid].status for _, jid in entries if jid in found]
        done, failed = outcomes.count("done"), outcomes.count("failed")
    return LineCounts(lines=status.lines, done=done, failed=failed + status.refused, refused=status.refused)


def job_states(client: Client, batch_id: str) -> list[JobState]:
    """Each input line with its job id and state, in submission order; the refused lines at the end."""
    entries = client.batch_entries(batch_id)
    ids = sorted({jid for _, jid in entries})
    found = client.results_for(ids)
    pending = [j for j in ids if j not in found]
    rq_status: dict[str, str | None] = {}
    for i in range(0, len(pending), _CHUNK):
        chunk = pending[i:i + _CHUNK]
        with client.connection.pipeline(transaction=False) as p:
            for j in chunk:
                p.hget(Job.key_for(j), "status")
            rq_status.update(zip(chunk, (r.decode() if r else None for r in p.execute())))
    out = []
    for cid, jid in entries:
        r = found.get(jid)
        if r is not None:
            err = f"{r.error.code}: {r.error.message}" if r.error is not None else None
            out.append(JobState(custom_id=cid, job_id=jid, state=r.status, error=err))
        else:
            out.append(JobState(custom_id=cid, job_id=jid, state=rq_status.get(jid) or "unknown"))
    out.extend(JobState(custom_id=x.custom_id, job_id=None, state="refused", error=f"{x.code}: {x.message}")
               for x in refused_lines(client.connection, batch_id))
    return out


def cancel_batch(client: Client, batch_id: str, *, code: str = "batch_cancelled",
                 message: str = "the batch was cancelled before this request finished") -> dict[str, int]:
    """Cancel the batch's jobs that have not ended: queued ones never run, running ones are stopped, a job
    another batch or request also waits for is left to it (pipeline.cancel). Each cancelled job is recorded
    failed with `code`, so collectors write its line. Returns how many jobs ended which way (KeyError for
    an unknown batch)."""
    from pipeline.cancel import cancel_unwanted_job

    client.batch_status(batch_id)
    client.connection.hset(keys.batch_key(batch_id), "cancelled", json.dumps(time.time()))
    ids = sorted({jid for _, jid in client.batch_entries(batch_id)})
    ended = client.results_for(ids)
    outcomes: dict[str, int] = {"ended": len(ended)} if ended else {}
    for jid in ids:
        if jid not in ended:
            what = cancel_unwanted_job(client.connection, jid, batch_id=batch_id, code=code, message=message,
                                       result_ttl=client.options.result_ttl, stream_ttl=client.options.stream_ttl)
            outcomes[what] = outcomes.get(what, 0) + 1
    return outcomes

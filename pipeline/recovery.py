"""Recovery: finding jobs whose worker died and giving them back to their queue (or failing them).

Every worker runs a Reaper every few seconds, idle or busy (from its heartbeat thread), and so does
every collector, so a batch recovers even when all workers are busy with long jobs:

* rq's own StartedJobRegistry.cleanup() on the queues, under a lock that expires in seconds (rq's
  maintenance lock lives 15 min, so a worker killed while holding it would stop all cleanups). A
  started job's registry entry outlives its worker's last heartbeat by a grace of seconds
  (pipeline.worker), so a dead worker's job is found within ~20 s, not at timeout + 60 s plus up to a
  10-minute maintenance interval. A job lost with its worker gets up to WORKER_LOSS_RETRIES extra runs
  (through rq's retries_left, so `--retries` stays for errors), at the front of its queue, then is
  recorded failed (worker_lost, by jobs.tasks.on_failure) - a job that kills every worker is bounded;
* recovery of job ids a dead worker had popped but not yet registered (pipeline.dequeue
  leaves a short-lived "popped" mark; an id in an intermediate list without one goes back);
* right after a Redis restart every entry looks overdue (nobody could beat): the reaper waits one
  heartbeat TTL before treating any as dead.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis.exceptions
from rq import Queue
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.timeouts import BaseDeathPenalty
from rq.utils import as_text

from jobs import keys
from jobs.redis_conn import SERIALIZER

log = logging.getLogger("rqllm.worker")

DEFAULT_HEARTBEAT_INTERVAL = 5
DEFAULT_HEARTBEAT_GRACE = 10  # a job's started-registry entry outlives the last beat by this much
DEFAULT_REAP_INTERVAL = 5.0  # seconds between reaper passes (per worker / collector)
REAP_LOCK_TTL = 10  # the per-queue cleaning lock frees itself this fast when its holder dies (a pass takes ms)
POPPED_MARK_TTL = 20  # a popped id not registered as started within this long is put back
WORKER_LOSS_RETRIES = 2  # extra runs for a job whose worker died under it, on top of --retries


# A started job whose registry entry expired (its worker stopped beating): allow one more run through
# rq's own retry, up to ARGV[1] times per job, at the front of the queue (rq's enqueue_at_front_on_retry).
# KEYS[1]: job hash. Returns the job's loss count, or -1 when it is not started (nothing to do).
_ALLOW_LOSS_RETRY = """
if redis.call('HGET', KEYS[1], 'status') ~= 'started' then return -1 end
local n = redis.call('HINCRBY', KEYS[1], 'rqllm_worker_losses', 1)
if n <= tonumber(ARGV[1]) then
  redis.call('HINCRBY', KEYS[1], 'retries_left', 1)
  redis.call('HSET', KEYS[1], 'enqueue_at_front_on_retry', '1')
end
return n
"""

# A job id left in an intermediate list by a worker that died between popping and registering it.
# KEYS: intermediate list, queue list, job hash, popped mark; ARGV[1]: job id.
# Returns 1 requeued at the front, 2 stale id dropped (job ended or gone), 0 left alone.
_REQUEUE_ORPHAN = """
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
local status = redis.call('HGET', KEYS[3], 'status')
if status == 'started' then return 0 end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
if status == 'queued' then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 2
"""


class Reaper:
    """Finds jobs whose worker died and gives them back to the queue (or fails them), within seconds.

    Run by every worker (idle loop and heartbeat thread) and by collectors, so a batch recovers even
    when all other workers are busy with long jobs. Passes on one queue never overlap: they hold the
    queue's rq cleaning lock (rq's registry_cleaning_key), taken here with a short TTL.
    """

    def __init__(self, connection: Any, queue_names: list[str], *, name: str,
                 interval: float = DEFAULT_REAP_INTERVAL, exception_handlers: list | None = None,
                 restart_grace: float = DEFAULT_HEARTBEAT_INTERVAL + DEFAULT_HEARTBEAT_GRACE + 5):
        self.connection = connection
        self.name = name
        self.interval = interval
        self.restart_grace = restart_grace
        self.queues = [Queue(q, connection=connection, serializer=SERIALIZER) for q in queue_names]
        self.exception_handlers = exception_handlers
        self._allow = connection.register_script(_ALLOW_LOSS_RETRY)
        self._orphan = connection.register_script(_REQUEUE_ORPHAN)
        self._mutex = threading.Lock()
        self._last = 0.0

    def maybe_run(self) -> list[tuple[str, str]]:
        """run() when the last pass is `interval` seconds old; never raises (logs instead)."""
        with self._mutex:
            if time.monotonic() - self._last < self.interval:
                return []
            self._last = time.monotonic()
        try:
            return self.run()
        except Exception:  # noqa: BLE001 - the next pass tries again
            log.warning("%s: reaper pass failed", self.name, exc_info=True)
            return []

    def run(self) -> list[tuple[str, str]]:
        """One pass over every queue; returns (job id, what happened) for each job acted on."""
        out: list[tuple[str, str]] = []
        for queue in self.queues:
            with self.locked(queue) as got:
                if got:
                    out += self.reap_queue(queue)
        return out

    @contextlib.contextmanager
    def locked(self, queue: Any) -> Iterator[bool]:
        lock = self.connection.lock(queue.registry_cleaning_key, timeout=REAP_LOCK_TTL, blocking=False)
        got = lock.acquire()
        try:
            yield bool(got)
        finally:
            if got:
                with contextlib.suppress(redis.exceptions.LockError):
                    lock.release()

    def reap_queue(self, queue: Any) -> list[tuple[str, str]]:
        """The caller holds the queue's cleaning lock."""
        out: list[tuple[str, str]] = []
        # rq runs the failure callback under a SIGALRM timeout, which only works in the main thread;
        # the reaper also runs in the heartbeat thread (the callback, jobs.tasks.on_failure, is short).
        registry = StartedJobRegistry(queue=queue, death_penalty_class=NoDeathPenalty)
        expired = registry.get_expired_job_ids()
        if expired and self._redis_just_restarted():
            # No worker could beat while Redis was down: their entries look overdue now. Give the live
            # ones a heartbeat interval to beat again before treating any as dead.
            expired = []
        losses: dict[str, int] = {}
        for job_id in expired:
            n = int(self._allow(keys=[Job.key_for(job_id)], args=[WORKER_LOSS_RETRIES]))
            if n >= 0:
                losses[job_id] = n
        if expired:
            # rq's own cleanup: retry (retries_left), or fail with AbandonedJobError (on_failure records it).
            registry.cleanup(exception_handlers=self.exception_handlers)
        for job_id, n in losses.items():
            status = self.connection.hget(Job.key_for(job_id), "status")
            what = f"worker lost ({n}x): " + (as_text(status) if status else "gone")
            log.warning("%s: job %s abandoned by its worker; now %s", self.name, job_id, what.split(": ")[1])
            out.append((job_id, what))
        return out + self._requeue_orphans(queue)

    def _redis_just_restarted(self) -> bool:
        return int(self.connection.info("server").get("uptime_in_seconds", 1e9)) < self.restart_grace

    def _requeue_orphans(self, queue: Any) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for raw in self.connection.lrange(queue.intermediate_queue_key, 0, -1):
            job_id = as_text(raw)
            r = int(self._orphan(keys=[queue.intermediate_queue_key, queue.key, Job.key_for(job_id),
                                       keys.popped_key(job_id)], args=[job_id]))
            if r == 1:
                log.warning("%s: job %s was popped by a worker that died before starting it; requeued",
                            self.name, job_id)
                out.append((job_id, "requeued (popped, never started)"))
        return out


class NoDeathPenalty(BaseDeathPenalty):
    """Timeouts are enforced cooperatively (jobs.runtime checks the deadline between tokens)."""

    def setup_death_penalty(self) -> None:
        pass

    def cancel_death_penalty(self) -> None:
        pass


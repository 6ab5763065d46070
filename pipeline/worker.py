"""The rqllm worker: one process, one engine loaded once, jobs run one at a time in-process.

Why not rq's Worker: it forks a work-horse per job, so the engine would be reloaded (or shared
copy-on-write after OpenMP threads started, which can deadlock: rq #1609). rq's SimpleWorker keeps the
engine but (a) sends no heartbeat during a job, so a long job looks dead or a dead worker's job is
noticed only after timeout + 60 s, and (b) enforces job timeouts with SIGALRM, which raises anywhere,
e.g. in the middle of a Redis reply. LLMWorker is a SimpleWorker with:

* a heartbeat thread during each job: extends the worker key, the execution, the started-registry
  entry and the job's last_heartbeat every `heartbeat_interval` s (5 s) with a short TTL
  (interval + grace = 15 s), so the started-registry entry of a SIGKILLed worker's job expires ~15 s
  after its last beat;
* a reaper (class Reaper) that every worker runs every few seconds, idle or busy (from the heartbeat
  thread), and that collectors run too: rq's own StartedJobRegistry.cleanup() on the worker's queues,
  under a lock that expires in seconds (rq's maintenance lock lives 15 min, so a worker killed while
  holding it would stop all cleanups), plus recovery of job ids a dead worker had popped but not yet
  registered. rq would notice a dead worker's job only at timeout + 60 s plus up to a 10-minute
  maintenance interval; this finds it within ~20 s. A job lost with its worker gets up to
  WORKER_LOSS_RETRIES extra runs (through rq's retries_left, so `--retries` stays for errors), at the
  front of its queue, then is recorded failed (worker_lost) - a job that kills every worker is bounded;
* Redis outages: every command retries with backoff for ~30 s (pipeline.redis_conn), so a restart is
  invisible; a job whose Redis writes still fail is put back at the front of its queue, not recorded
  failed (the outage is not the job's fault); when rq's work loop quits on a Redis error, run_worker
  waits for Redis and starts it again; right after a Redis restart the reaper waits one heartbeat TTL
  (every job's entry looks overdue then, as nobody could beat);
* cooperative timeouts: no SIGALRM; the engine's should_stop() checks the job's deadline between tokens;
* a loss-free priority dequeue (below);
* an allowlist check before running anything (jobs.allowlist);
* signals that only set flags: the first SIGTERM/SIGINT finishes the current job then exits; a second
  one (>= 1 s later) makes should_stop() true, the job is put back at the front of its queue, and the
  worker exits. Nothing is raised from a signal handler, so no Redis call is cut in half.

Dequeue: rq's Queue.dequeue_any uses BLMOVE (atomic, into the queue's intermediate list) only for a
single queue; for several queues (our high/default/low) it uses BLPOP, and a worker dying between
the pop and registering the job loses it (rq #1716). LLMWorker never BLPOPs a queue: it tries a
non-blocking LMOVE on each queue in priority order (each job id lands atomically in that queue's
intermediate list, with a short-lived "popped" mark; if we die before registering the job, the reaper
puts the id back at the front of its queue once the mark has expired), and when all are empty it blocks on a
per-model "doorbell" list that producers push to (BLPOP of a doorbell token loses nothing but a
wake-up; the wait is capped at 1 s so jobs requeued by rq itself are also seen).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import click
import redis.exceptions
from rq import SimpleWorker, worker_registration
from rq.exceptions import StopRequested
from rq.job import Job, JobStatus
from rq.logutils import setup_loghandlers
from rq.registry import FailedJobRegistry, FinishedJobRegistry, ReadyJobRegistry, StartedJobRegistry
from rq.timeouts import BaseDeathPenalty
from rq.utils import as_text, now
from rq.worker.base import WorkerStatus

from engine.cpus import ThreadChoice, ThreadSettingError, choose_threads
from jobs import keys, runtime
from jobs.allowlist import check_job
from jobs.runtime import JobInterrupted, RedisUnavailable, TaskFailed
from jobs.schemas import model_key, queue_names
from jobs.tasks import record_rq_failure
from pipeline.cli_engine import kv_type_option, no_repack_option, speculation_mode, speculation_options
from pipeline.memory_guard import check_worker_start, no_memory_check_option
from pipeline.redis_conn import REDIS_DOWN_ERRORS, SERIALIZER, connect, wait_for_redis

log = logging.getLogger("rqllm.worker")
# The repacked cache's progress and warnings while the engine loads (before rq's work loop starts).
log_repack = logging.getLogger("rqllm.repack")

DEFAULT_HEARTBEAT_INTERVAL = 5
DEFAULT_MAINTENANCE_INTERVAL = 60
DEFAULT_HEARTBEAT_GRACE = 10  # a job's started-registry entry outlives the last beat by this much
DEFAULT_REAP_INTERVAL = 5.0  # seconds between reaper passes (per worker / collector)
REAP_LOCK_TTL = 10  # the per-queue cleaning lock frees itself this fast when its holder dies (a pass takes ms)
POPPED_MARK_TTL = 20  # a popped id not registered as started within this long is put back
WORKER_LOSS_RETRIES = 2  # extra runs for a job whose worker died under it, on top of --retries
DOORBELL_WAIT = 1
POPPED_PREFIX = "rqllm:popped:"


# KEYS: queue1, intermediate1, queue2, intermediate2, ... (priority order)
# ARGV[1]: job key prefix, ARGV[2]: popped-mark prefix, ARGV[3]: worker name, ARGV[4]: mark ttl
_POP_FIRST = """
for i = 1, #KEYS, 2 do
  local id = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'LEFT', 'RIGHT')
  if id then
    redis.call('SET', ARGV[2] .. id, ARGV[3], 'EX', ARGV[4])
    return {(i + 1) / 2, id, redis.call('HGETALL', ARGV[1] .. id)}
  end
end
return false
"""

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
        from rq import Queue

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
                                       POPPED_PREFIX + job_id], args=[job_id]))
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


def _say(msg: str) -> None:
    # Used from signal handlers: a plain write, no locks.
    try:
        os.write(2, (msg + "\n").encode())
    except OSError:
        pass


class _Heartbeat(threading.Thread):
    """One long-lived thread that beats for the job in progress (no thread start/join per job)."""

    def __init__(self, worker: LLMWorker, interval: float):
        super().__init__(name="rqllm-heartbeat", daemon=True)
        self.worker, self.interval = worker, interval
        self._lock = threading.Lock()
        self._current: tuple[Job, Any] | None = None
        self._halt = threading.Event()
        self.beats = 0

    def begin(self, job: Job, execution: Any) -> None:
        with self._lock:
            self._current = (job, execution)

    def end(self) -> None:
        with self._lock:
            self._current = None

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            with self._lock:
                current = self._current
            if current is None:
                continue
            try:
                # xx-only updates: a beat racing the job's end cannot re-register it
                self.worker.maintain_heartbeats(*current)
                self.beats += 1
            except Exception:  # noqa: BLE001 - a missed beat is retried next interval
                log.warning("heartbeat for job %s failed", current[0].id, exc_info=True)
            # A busy worker reaps too, so a dead worker's job is found even when no worker is idle.
            self.worker.reaper.maybe_run()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class LLMWorker(SimpleWorker):
    death_penalty_class = NoDeathPenalty

    def __init__(self, queues: Any, *, model: str, heartbeat_interval: int = DEFAULT_HEARTBEAT_INTERVAL,
                 maintenance_interval: int = DEFAULT_MAINTENANCE_INTERVAL,
                 heartbeat_grace: int = DEFAULT_HEARTBEAT_GRACE, **kwargs: Any):
        kwargs.setdefault("serializer", SERIALIZER)
        super().__init__(queues, job_monitoring_interval=heartbeat_interval,
                         maintenance_interval=maintenance_interval, **kwargs)
        self.model = model
        self.model_key = model_key(model)
        self.doorbell = keys.doorbell_key(self.model_key)
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_grace = heartbeat_grace
        self._pop_script = self.connection.register_script(_POP_FIRST)
        self._force_stop = False
        self._outcome_recorded: str | None = None  # the job whose failure its task recorded itself
        self._beat: _Heartbeat | None = None
        self._current_job_id: str | None = None
        self._last_idle_beat = 0.0
        self._said_ready = False
        self._popped_by = json.dumps(self.name)  # every rqllm:* value is JSON
        self.reaper = Reaper(self.connection, self.queue_names(), name=self.name,
                             exception_handlers=self._exc_handlers,
                             restart_grace=heartbeat_interval + heartbeat_grace + 5)
        # Why work() returned: rq's loop quits on any exception; run_worker starts again when it was Redis.
        self.redis_error: BaseException | None = None
        self.idle_exit = False
        self.jobs_run = 0

    def teardown(self) -> None:
        if self._beat is not None:
            self._beat.stop()
            self._beat = None
        super().teardown()

    # ------------------------------------------------------------ identity
    def serialize(self) -> dict:
        data = super().serialize()
        data["rqllm_model"] = self.model
        return data

    # ------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self._stop_requested:
            self._stop_requested = True
            self._shutdown_requested_date = now()
            _say(f"rqllm worker {self.name}: {signal.Signals(signum).name}: finishing the current job, then "
                 "exiting (signal again to stop now and requeue the job)")
            return
        if self._shutdown_requested_date and (now() - self._shutdown_requested_date).total_seconds() < 1:
            return  # the same signal delivered twice (process group + direct)
        if not self._force_stop:
            self._force_stop = True
            _say(f"rqllm worker {self.name}: stopping now; the current job goes back to its queue")

    def should_stop_generating(self) -> bool:
        return self._force_stop or (self._stopped_job_id is not None and self._stopped_job_id == self._current_job_id)

    # ------------------------------------------------------------ dequeue
    def _pop_any(self) -> tuple[Job, Any] | None:
        """One round trip: LMOVE from the first non-empty queue in priority order into that queue's
        intermediate list, and read the job hash (as Job.fetch would)."""
        queues = self._ordered_queues
        keys_ = [k for q in queues for k in (q.key, q.intermediate_queue_key)]
        while True:
            reply = self._pop_script(keys=keys_, args=[self.job_class.redis_job_namespace_prefix, POPPED_PREFIX,
                                                       self._popped_by, POPPED_MARK_TTL])
            if not reply:
                return None
            idx, raw_id, flat = reply
            queue = queues[int(idx) - 1]
            job_id = as_text(raw_id)
            if not flat:
                self.connection.lrem(queue.intermediate_queue_key, 1, job_id)  # job hash gone: skip it
                continue
            job = self.job_class(job_id, connection=self.connection, serializer=self.serializer)
            job.restore(dict(zip(flat[::2], flat[1::2])))
            return job, queue

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None):
        qnames = ",".join(self.queue_names())
        self.set_state(WorkerStatus.IDLE)
        self.procline("Listening on " + qnames)
        idle_since = time.monotonic()
        backoff = 1.0
        while True:
            if self._stop_requested:
                raise StopRequested()
            try:
                if time.monotonic() - self._last_idle_beat >= min(5, self.heartbeat_interval):
                    self.heartbeat()
                    self._last_idle_beat = time.monotonic()
                if self.should_run_maintenance_tasks:
                    self.run_maintenance_tasks()
                self.reaper.maybe_run()
                result = self._pop_any()
                if result is not None:
                    job, queue = result
                    job.redis_server_version = self.get_redis_server_version()
                    self.log.info("Worker %s: %s: %s", self.name, queue.name, job.id)
                    return result
                if timeout is None:
                    self.idle_exit = True
                    return None  # burst: all queues empty
                if max_idle_time is not None and time.monotonic() - idle_since >= max_idle_time:
                    self.idle_exit = True
                    return None
                if not self._said_ready:
                    # bench/bench_startup.py times a worker's start-up up to this line
                    self.log.info("Worker %s: ready, waiting for jobs on %s", self.name, qnames)
                    self._said_ready = True
                self.connection.blpop([self.doorbell], timeout=DOORBELL_WAIT)
                backoff = 1.0
            except REDIS_DOWN_ERRORS as e:
                self.log.error("Worker %s: Redis unreachable (%s), retrying in %.0f s", self.name, e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, self.max_connection_wait_time)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """rq's heartbeat is three commands; send them as one pipeline. A bare call less than a second
        after the previous beat (rq's work loop beats after every job) is skipped."""
        if pipeline is not None:
            return super().heartbeat(timeout, pipeline=pipeline)
        if timeout is None and self.last_heartbeat is not None and \
                (now() - self.last_heartbeat).total_seconds() < 1.0:
            return None
        with self._noting_redis_errors(), self.connection.pipeline(transaction=False) as p:
            super().heartbeat(timeout, pipeline=p)
            p.execute()
        return None

    def set_state(self, state: str, pipeline: Any = None) -> None:
        if pipeline is None and state == self._state == WorkerStatus.IDLE:
            return  # already recorded (SimpleWorker and the dequeue loop both set IDLE)
        super().set_state(state, pipeline=pipeline)

    def clean_registries(self) -> None:
        """rq's maintenance, under the reaper's short-lived lock (rq's own lock lives 15 min, so a worker
        killed mid-pass would block every cleanup that long), with the reaper's pass first."""
        for queue in self.queues:
            with self.reaper.locked(queue) as got:
                if got:
                    self.reaper.reap_queue(queue)  # the started registry (rq's cleanup, after a restart grace)
                    # the rest of rq's clean_registries (its started-registry pass would skip that grace)
                    for registry_class in (FinishedJobRegistry, FailedJobRegistry, ReadyJobRegistry):
                        registry_class(queue=queue).cleanup()
                    worker_registration.clean_worker_registry(queue)
                    queue.intermediate_queue.cleanup(self, queue)
        self.last_cleaned_at = now()

    # rq's work loop quits on any exception from these; note when it was Redis going away.
    def check_for_suspension(self, burst: bool) -> None:
        with self._noting_redis_errors():
            super().check_for_suspension(burst)

    def run_maintenance_tasks(self) -> None:
        with self._noting_redis_errors():
            super().run_maintenance_tasks()

    @contextlib.contextmanager
    def _noting_redis_errors(self) -> Iterator[None]:
        try:
            yield
        except REDIS_DOWN_ERRORS as e:
            self.redis_error = e
            raise

    # ------------------------------------------------------------ execution
    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # SimpleWorker's is timeout + 60 s (it never beats during a job); we beat, so keep it short.
        return int(max(1, min(job.timeout - working_time if job.timeout and job.timeout > 0 else 1e9,
                              self.heartbeat_interval))) + self.heartbeat_grace

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        # rq removes the id from the intermediate list only with a single queue; we always LMOVE into it.
        super().prepare_job_execution(job, remove_from_intermediate_queue=True)

    def execute_job(self, job: Job, queue: Any) -> None:
        with self._noting_redis_errors():
            self._execute_job(job, queue)

    def _execute_job(self, job: Job, queue: Any) -> None:
        reason = check_job(job)
        if reason is not None:
            self._refuse(job, queue, reason)
            self.set_state(WorkerStatus.IDLE)
            return
        execution = self.prepare_execution(job)
        self._current_job_id = job.id
        if self._beat is None:
            self._beat = _Heartbeat(self, self.heartbeat_interval)
            self._beat.start()
        self._beat.begin(job, execution)
        try:
            self.perform_job(job, queue, execution)
        finally:
            self._beat.end()
            self._current_job_id = None
            self.jobs_run += 1
            if self.jobs_run == 1:
                # the first job's one-off allocations (tokenizer lookup tables, template) stay freed,
                # not private to this process (bench_memory.py --pss)
                from engine.engine import release_freed_heap

                release_freed_heap()
        self.set_state(WorkerStatus.IDLE)

    def _refuse(self, job: Job, queue: Any, reason: str) -> None:
        self.log.error("Worker %s: refusing job %s: %s", self.name, job.id, reason)
        # Never run anything the job names: no callbacks, no webhooks, no retry.
        job._success_callback_name = job._failure_callback_name = job._stopped_callback_name = None
        job._success_callback = job._failure_callback = job._stopped_callback = None
        job.webhooks = []
        job.retries_left = 0
        execution = self.prepare_execution(job)
        self.connection.lrem(queue.intermediate_queue_key, 1, job.id)
        job.ended_at = now()
        self.handle_job_failure(job, queue, exc_string=f"RefusedJob: {reason}", execution=execution)

    def _finalize_failure(self, job: Job, queue: Any, execution: Any, exc_info: Any) -> None:
        exc_type = exc_info[0]
        if exc_type is not None and issubclass(exc_type, JobInterrupted) and self._stopped_job_id != job.id:
            self._requeue(job, queue, execution)
            return
        if exc_type is not None and issubclass(exc_type, RedisUnavailable):
            # Redis is reachable again (or this raises and the reaper requeues the job later).
            self._requeue(job, queue, execution, stop=False, why=f"Redis unavailable: {exc_info[1]}")
            return
        # A TaskFailed outcome is already recorded by the task. Recording "if absent" again afterwards is
        # not harmless: a producer may have cleared that failed result meanwhile (its claim re-runs the
        # job), and a second record would then be a spurious worker_error for the new run's waiters.
        self._outcome_recorded = job.id if exc_type is not None and issubclass(exc_type, TaskFailed) else None
        try:
            super()._finalize_failure(job, queue, execution, exc_info)
        finally:
            self._outcome_recorded = None

    def _requeue(self, job: Job, queue: Any, execution: Any, *, stop: bool = True, why: str = "interrupted") -> None:
        """Put a job back at the front of its queue, as if it had never started; then stop the worker
        (a forced stop) or go on (a Redis outage)."""
        with self.connection.pipeline() as p:
            self.cleanup_execution(job, pipeline=p, execution=execution)
            job.set_status(JobStatus.QUEUED, pipeline=p)
            p.hset(job.key, mapping={"started_at": "", "worker_name": ""})
            p.lrem(queue.intermediate_queue_key, 0, job.id)
            queue.push_job_id(job.id, pipeline=p, at_front=True)
            p.execute()
        if stop:
            self._stop_requested = True
        self.log.warning("Worker %s: job %s requeued (%s)", self.name, job.id, why)

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        if exc_info and exc_info[0] is not None and issubclass(exc_info[0], TaskFailed):
            # An outcome the task already recorded (e.g. a request the engine refuses): one line, no traceback.
            self.log.warning("Worker %s: job %s failed: %s", self.name, job.id, exc_info[1])
            from rq.job_lifecycle import call_exception_handlers

            call_exception_handlers(self._exc_handlers, job, *exc_info)
            return
        super().handle_exception(job, *exc_info)

    def handle_job_failure(self, job: Job, queue: Any, started_job_registry: Any = None, exc_string: str = "",
                           execution: Any = None) -> None:
        super().handle_job_failure(job, queue, started_job_registry=started_job_registry, exc_string=exc_string,
                                   execution=execution)
        status = job.get_status(refresh=False)
        if status in (JobStatus.FAILED, JobStatus.STOPPED) and self._outcome_recorded != job.id:
            # Failures rq decides on (stuck in the intermediate list, refused, stopped, errors outside the
            # task's own handling) still reach the batches. No-op when the task recorded its outcome.
            lines = [ln for ln in (exc_string or "").strip().splitlines() if ln.strip()]
            why = lines[-1] if lines else "failed"
            code = "stopped" if status == JobStatus.STOPPED else ("refused" if why.startswith("RefusedJob") else
                                                                  "worker_error")
            try:
                record_rq_failure(self.connection, job, code, why)
            except Exception:  # noqa: BLE001
                self.log.exception("Worker %s: could not record the failure of job %s", self.name, job.id)


def default_worker_name(model: str) -> str:
    return f"{model_key(model)}.{socket.gethostname()}.{os.getpid()}"


def load_engine(model: str, threads: int | None, kv_budget: str | None, repack: bool | None = None,
                draft: str | None = None, speculative: str = "off") -> Any:
    """draft / speculative: engine.Engine's (a draft model; the mode for jobs that do not choose one)."""
    from engine import repack as repack_cache
    from engine.engine import Engine

    kw: dict[str, Any] = {"threads": threads, "repack": repack, "draft": draft, "speculative": speculative,
                          "repack_progress": repack_cache.LogProgress(model, logger=log_repack)}
    if kv_budget:
        kw["kv_budget"] = kv_budget
    return Engine(model, **kw)


def speculation_line(engine: Any) -> str:
    """The start-up line's word on speculative decoding: the jobs' default mode and the draft model."""
    draft = getattr(engine, "draft", None)
    mode = getattr(engine, "speculative", "off")
    return f"{mode} by default" + (f", draft model {draft.name}" if draft is not None else "")


def weight_layout(engine: Any) -> str:
    """What the start-up line says about the weights: the repacked cache's path, or the GGUF layout and why."""
    layout = getattr(getattr(engine, "model", None), "layout", None)
    return layout.describe() if layout is not None else "weight layout unknown"


def run_worker(model: str, *, redis_url: str | None = None, threads: int | ThreadChoice | None = None,
               kv_budget: str | None = None, burst: bool = False, name: str | None = None,
               max_jobs: int | None = None, heartbeat_interval: int = DEFAULT_HEARTBEAT_INTERVAL,
               maintenance_interval: int = DEFAULT_MAINTENANCE_INTERVAL,
               heartbeat_grace: int = DEFAULT_HEARTBEAT_GRACE, engine: Any = None,
               logging_level: str = "INFO", flush_interval: float = 0.05, repack: bool | None = None,
               draft: str | None = None, speculative: str = "off") -> bool:
    """Load the engine once, then work the model's high/default/low queues. Returns whether any job ran.

    `threads`: an explicit count (--threads), a choice already made, or None for engine.cpus to choose.
    `repack`: the repacked weight cache (engine.repack): None = the default, False = --no-repack.
    `draft`, `speculative`: speculative decoding's draft model and default mode (--draft, --prompt-lookup)."""
    connection = connect(redis_url)
    connection.ping()
    name = name or default_worker_name(model)
    logging.getLogger("rqllm").setLevel(logging_level)
    # rq installs its log handlers only when work() starts: without this the start-up line was dropped.
    setup_loghandlers(logging_level, name="rq.worker")
    # A first load may repack the weights for a minute: its progress goes to the worker's log too.
    setup_loghandlers(logging_level, name=log_repack.name)
    t0 = time.monotonic()
    if engine is None:
        choice = threads if isinstance(threads, ThreadChoice) else choose_threads(threads)
        engine = load_engine(model, choice.threads, kv_budget, repack=repack, draft=draft, speculative=speculative)
    else:
        choice = ThreadChoice(getattr(engine, "threads", 0), "the engine passed in")
    worker = LLMWorker(queue_names(model), model=model, name=name, connection=connection,
                       heartbeat_interval=heartbeat_interval, maintenance_interval=maintenance_interval,
                       heartbeat_grace=heartbeat_grace)
    runtime.set_context(runtime.WorkerContext(
        engine=engine, connection=connection, worker_name=worker.name,
        force_stop=worker.should_stop_generating, flush_interval=flush_interval,
    ))
    worker.log.info("Worker %s: model %s loaded in %.1f s; %d engine threads (%s); queues %s; weights: %s; "
                    "speculative decoding: %s", worker.name, model, time.monotonic() - t0, choice.threads,
                    choice.reason, ", ".join(worker.queue_names()), weight_layout(engine), speculation_line(engine))
    worked = False
    try:
        while True:
            try:
                worked = worker.work(burst=burst, max_jobs=max_jobs, logging_level=logging_level) or worked
            except REDIS_DOWN_ERRORS as e:  # teardown (register_death) with Redis away
                worker.redis_error = worker.redis_error or e
            if worker.redis_error is None or worker._stop_requested or worker.idle_exit or \
                    (max_jobs is not None and worker.jobs_run >= max_jobs):
                return worked
            # rq's loop quit because Redis stayed away longer than the client's retries: wait, go on.
            old = worker
            worker.log.error("Worker %s: lost Redis (%s); waiting for it", name, worker.redis_error)
            if not wait_for_redis(connection, stop=lambda: old._stop_requested, log=worker.log.warning):
                return worked
            connection.delete(old.key)  # our own stale registration (its teardown could not reach Redis)
            worker = LLMWorker(queue_names(model), model=model, name=name, connection=connection,
                               heartbeat_interval=heartbeat_interval, maintenance_interval=maintenance_interval,
                               heartbeat_grace=heartbeat_grace)
            if max_jobs is not None:
                max_jobs -= old.jobs_run
            runtime.get_context().force_stop = worker.should_stop_generating
            worker.log.info("Worker %s: Redis is back; resuming", name)
    finally:
        runtime.set_context(None)


@click.command("worker")
@click.option("--model", "-m", required=True, help="Model name (smollm2-135m, gemma3-270m) or .gguf path.")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="Engine threads (default: $RQLLM_THREADS, else the CPUs this process may use: affinity mask "
                   "and cgroup CPU quota).")
@click.option("--kv-budget", default=None, help="KV cache budget, e.g. 256MiB.")
@click.option("--burst", is_flag=True, help="Exit when the queues are empty.")
@click.option("--name", default=None, help="Worker name (default <model>.<host>.<pid>).")
@click.option("--redis-url", envvar="REDIS_URL", default=None, help="Redis URL (default $REDIS_URL).")
@click.option("--max-jobs", type=int, default=None, help="Exit after this many jobs.")
@click.option("--heartbeat-interval", type=int, default=DEFAULT_HEARTBEAT_INTERVAL, show_default=True)
@click.option("--heartbeat-grace", type=int, default=DEFAULT_HEARTBEAT_GRACE, show_default=True,
              help="Seconds after the last heartbeat before a job counts as abandoned.")
@click.option("--maintenance-interval", type=int, default=DEFAULT_MAINTENANCE_INTERVAL, show_default=True,
              help="Seconds between rq's registry cleanups (a dead worker's job is found within "
                   "heartbeat interval + grace + 5 s regardless).")
@click.option("--log-level", default="INFO", show_default=True)
@no_memory_check_option
@no_repack_option
@kv_type_option
@speculation_options
def worker_command(model: str, threads: int | None, kv_budget: str | None, burst: bool, name: str | None,
                   redis_url: str | None, max_jobs: int | None, heartbeat_interval: int, heartbeat_grace: int,
                   maintenance_interval: int, log_level: str, no_repack: bool, prompt_lookup: bool,
                   draft: str | None) -> None:
    """Run one worker process for MODEL: load the engine once, generate queued jobs one at a time.

    --prompt-lookup / --draft MODEL: jobs that leave params.speculative unset decode speculatively
    (with both, prompt lookup is the default and jobs may ask for the draft model)."""
    try:
        thread_choice = choose_threads(threads)
    except ThreadSettingError as e:
        raise click.UsageError(str(e)) from None
    repack = False if no_repack else None
    # a bad model file or not enough memory: say so before loading
    check_worker_start(model, kv_budget, repack=repack, draft=draft)
    run_worker(model, redis_url=redis_url, threads=thread_choice, kv_budget=kv_budget, burst=burst, name=name,
               max_jobs=max_jobs, heartbeat_interval=heartbeat_interval, heartbeat_grace=heartbeat_grace,
               maintenance_interval=maintenance_interval, logging_level=log_level.upper(), repack=repack,
               draft=draft, speculative=speculation_mode(prompt_lookup, draft))


if __name__ == "__main__":
    sys.exit(worker_command(prog_name="rqllm worker"))

"""The rqllm worker: one process, one engine loaded once, jobs run one at a time in-process.

Why not rq's Worker: it forks a work-horse per job, so the engine would be reloaded (or shared
copy-on-write after OpenMP threads started, which can deadlock: rq #1609). rq's SimpleWorker keeps the
engine but sends no heartbeat during a job (a dead worker's job is noticed only after timeout + 60 s)
and enforces timeouts with SIGALRM, which raises anywhere, e.g. mid Redis reply. LLMWorker adds:

* a heartbeat thread during each job (every 5 s, TTL interval + grace = 15 s), so a SIGKILLed
  worker's job is found within seconds by the reaper (pipeline.recovery) that every worker runs;
* Redis outages: commands retry for ~30 s (jobs.redis_conn); a job whose writes still fail goes back
  to the front of its queue (pipeline.job_endings), and run_worker waits for Redis and goes on;
* cooperative timeouts (checked between tokens, and while a model's chat template renders: pipeline.job_engine),
  an allowlist check before running anything
  (jobs.allowlist), and signals that only set flags: the first SIGTERM/SIGINT finishes the current job
  then exits, a second one (>= 1 s later) stops generating and requeues the job;
* a loss-free priority dequeue (pipeline.dequeue), and when all queues are empty a wait on a per-model
  "doorbell" list that producers push to (capped at 1 s, so jobs requeued by rq itself are seen too).

rq's public API has no hooks for most of this, so LLMWorker overrides rq methods and reads a few of
its private attributes; each override says why. tests/test_rq_contract.py fails loudly when an rq
release renames or re-signs any of them (hence the rq<3.1 pin in pyproject.toml).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

from rq import SimpleWorker, worker_registration
from rq.exceptions import StopRequested
from rq.job import Job
from pipeline.job_heartbeat import JobHeartbeat
from pipeline.worker_logging import setup_worker_logging
from rq.registry import FailedJobRegistry, FinishedJobRegistry, ReadyJobRegistry
from rq.utils import now
from rq.worker.base import WorkerStatus

from engine.cpus import ThreadChoice, choose_threads
from jobs import keys, runtime
from jobs.allowlist import check_job
from jobs.redis_conn import REDIS_DOWN_ERRORS, SERIALIZER, connect, redis_url_from_env, wait_for_redis
from jobs.schemas import model_key, queue_names
from pipeline.dequeue import PriorityDequeue
from pipeline.job_endings import JobEndings
from pipeline import model_header
from pipeline.job_engine import JobEngine, describe_engine, load_engine
from pipeline.recovery import DEFAULT_HEARTBEAT_GRACE, DEFAULT_HEARTBEAT_INTERVAL, NoDeathPenalty, Reaper
from pipeline.readiness import Readiness, ReadyFile

log = logging.getLogger("rqllm.worker")

DEFAULT_MAINTENANCE_INTERVAL = 60
DOORBELL_WAIT = 1
# The line a worker logs before its first wait for jobs: bench/bench_startup.py and tests time
# a worker's start-up up to it.
READY_LINE = "ready, waiting for jobs"


def _say(msg: str) -> None:
    with contextlib.suppress(OSError):  # used from signal handlers: a plain write, no locks
        os.write(2, (msg + "\n").encode())


class LLMWorker(JobEndings, SimpleWorker):
    death_penalty_class = NoDeathPenalty

    def __init__(self, queues: Any, *, model: str, heartbeat_interval: int = DEFAULT_HEARTBEAT_INTERVAL,
                 maintenance_interval: int = DEFAULT_MAINTENANCE_INTERVAL,
                 heartbeat_grace: int = DEFAULT_HEARTBEAT_GRACE, kv_tokens: int = 0, **kwargs: Any):
        kwargs.setdefault("serializer", SERIALIZER)
        super().__init__(queues, job_monitoring_interval=heartbeat_interval,
                         maintenance_interval=maintenance_interval, **kwargs)
        self.model = model
        self.model_key = model_key(model)
        self.doorbell = keys.doorbell_key(self.model_key)
        self.heartbeat_interval, self.heartbeat_grace = heartbeat_interval, heartbeat_grace
        self.kv_tokens = kv_tokens  # its engine's KV capacity: producers size prompts by it (summarize)
        self._dequeue = PriorityDequeue(self.connection, popped_by=self.name)
        self._force_stop = False
        self._beat: JobHeartbeat | None = None
        self._current_job_id: str | None = None
        self._last_idle_beat = 0.0
        self._said_ready = False
        self.reaper = Reaper(self.connection, self.queue_names(), name=self.name,
                             exception_handlers=self._exc_handlers,
                             restart_grace=heartbeat_interval + heartbeat_grace + 5)
        # Why work() returned: rq's loop quits on any exception; run_worker starts again when it was Redis.
        self.redis_error: BaseException | None = None
        self.idle_exit = False
        self.jobs_run = 0

    # rq: teardown() is the one place rq's work loop ends through on every path; the beat thread stops there.
    def teardown(self) -> None:
        if self._beat is not None:
            self._beat.stop()
            self._beat = None
        super().teardown()

    # ------------------------------------------------------------ identity
    # rq: the worker hash has no field for user data; `rqllm status` and summarize count workers per model,
    # and a producer-only summarize plans its chunks by the smallest KV capacity among them.
    def serialize(self) -> dict:
        data = super().serialize()
        data["rqllm_model"], data["rqllm_kv_tokens"] = self.model, self.kv_tokens
        return data

    # ------------------------------------------------------------ signals
    # rq (private): its handlers raise from the signal (StopRequested / SystemExit on the second), which can
    # cut a Redis reply in half; rq has no option for flag-only handlers. _stop_requested and
    # _shutdown_requested_date are the flags rq's own loop reads.
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

    # rq (private): _stopped_job_id is where rq's stop-job command handler notes the job to stop (no getter).
    def should_stop_generating(self) -> bool:
        return self._force_stop or (self._stopped_job_id is not None and self._stopped_job_id == self._current_job_id)

    # ------------------------------------------------------------ dequeue
    def pop_job(self) -> tuple[Job, Any] | None:
        """The next job id from the first non-empty queue, in priority order (pipeline.dequeue)."""
        return self._dequeue.pop(self._ordered_queues, self.job_class, self.serializer)

    # rq: the work loop's one dequeue step; rq's BLPOPs several queues (rq #1716) and knows no doorbell.
    # _ordered_queues (private) is rq's priority order of our queues.
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
                result = self.pop_job()
                if result is not None:
                    job, queue = result
                    job.redis_server_version = self.get_redis_server_version()
                    self.log.debug("Worker %s: %s: %s", self.name, queue.name, job.id)  # INFO: the job's end line
                    return result
                if timeout is None:
                    self.idle_exit = True
                    return None  # burst: all queues empty
                if max_idle_time is not None and time.monotonic() - idle_since >= max_idle_time:
                    self.idle_exit = True
                    return None
                if not self._said_ready:
                    # bench/bench_startup.py times a worker's start-up up to this line
                    self.log.info("Worker %s: %s on %s", self.name, READY_LINE, qnames)
                    self._said_ready = True
                self.connection.blpop([self.doorbell], timeout=DOORBELL_WAIT)
                backoff = 1.0
            except REDIS_DOWN_ERRORS as e:
                self.log.error("Worker %s: Redis unreachable (%s), retrying in %.0f s", self.name, e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, self.max_connection_wait_time)

    # rq: its heartbeat sends three commands on its own; rq's loop also beats after every job.
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

    # rq: its maintenance takes a 15-minute lock and would skip the reaper's restart grace.
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

    # rq: its work loop quits on any exception from these and swallows it; note when it was Redis going away
    # (run_worker then waits for Redis and starts again).
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
    # rq: SimpleWorker's is timeout + 60 s (it never beats during a job); we beat, so keep it short.
    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return int(max(1, min(job.timeout - working_time if job.timeout and job.timeout > 0 else 1e9,
                              self.heartbeat_interval))) + self.heartbeat_grace

    # rq: it removes the id from the intermediate list only with a single queue; we always LMOVE into it.
    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        super().prepare_job_execution(job, remove_from_intermediate_queue=True)

    # rq: the allowlist check must come before rq touches the job's callbacks; the beat thread wraps the run.
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
            self._beat = JobHeartbeat(self, self.heartbeat_interval)
            self._beat.start()
        self._beat.begin(job, execution)
        if self.metrics is not None:
            self.metrics.busy(True)
        try:
            self.perform_job(job, queue, execution)
        finally:
            self._beat.end()
            self._current_job_id = None
            if self.metrics is not None:
                self.metrics.busy(False)
            self.jobs_run += 1
            if self.jobs_run == 1:
                # the first job's one-off allocations (tokenizer lookup tables, template) stay freed,
                # not private to this process (bench_memory.py --pss)
                from engine.engine import release_freed_heap

                release_freed_heap()
        self.set_state(WorkerStatus.IDLE)


def default_worker_name(model: str) -> str:
    return f"{model_key(model)}.{socket.gethostname()}.{os.getpid()}"


def run_worker(model: str, *, redis_url: str | None = None, threads: int | ThreadChoice | None = None,
               kv_budget: str | None = None, burst: bool = False, name: str | None = None,
               max_jobs: int | None = None, heartbeat_interval: int = DEFAULT_HEARTBEAT_INTERVAL,
               maintenance_interval: int = DEFAULT_MAINTENANCE_INTERVAL,
               heartbeat_grace: int = DEFAULT_HEARTBEAT_GRACE, engine: Any = None,
               logging_level: str = "INFO", flush_interval: float = 0.05, repack: bool | None = None,
               draft: str | None = None, speculative: str = "off", metrics_port: int | None = None,
               metrics_addr: str = "127.0.0.1", ready_file: str | None = None) -> bool:
    """Load the engine once, then work the model's high/default/low queues. Returns whether any job ran.

    `threads`: an explicit count (--threads), a choice already made, or None for engine.cpus to choose.
    `repack`: the repacked weight cache (engine.repack): None = the default, False = --no-repack.
    `draft`, `speculative`: speculative decoding's draft model and default mode (--draft, --prompt-lookup).
    `metrics_port`, `metrics_addr`: serve Prometheus metrics there (pipeline.worker_metrics).
    `ready_file`: a file that exists only while the worker is ready (its model loaded, Redis reachable)."""
    ready_signal = ReadyFile(ready_file)  # a stale one goes before anything else
    connection = connect(redis_url)
    # Redis away at start: say where we wait at once (not after ~30 s of retries), back off until it answers
    default = "" if redis_url or redis_url_from_env() else " (REDIS_URL is not set: the local default)"
    wait_for_redis(connection, log=lambda msg: _say(f"rqllm worker: {msg}{default}"))
    name = name or default_worker_name(model)
    # A first load may repack the weights for a minute: its progress goes to the worker's log too.
    setup_worker_logging(logging_level)
    metrics = server = None
    if metrics_port is not None:
        from pipeline.worker_metrics import WorkerMetrics, serve_metrics  # prometheus-client: only when asked

        metrics = WorkerMetrics(model)
        server = serve_metrics(metrics, metrics_port, metrics_addr)  # before the load: a scrape sees "not ready"
    readiness = Readiness(ready_signal, metrics.ready if metrics is not None else None)
    try:
        return _load_and_work(model, connection, name, readiness, metrics, threads=threads, kv_budget=kv_budget,
                              burst=burst, max_jobs=max_jobs, heartbeat_interval=heartbeat_interval,
                              maintenance_interval=maintenance_interval, heartbeat_grace=heartbeat_grace,
                              engine=engine, logging_level=logging_level, flush_interval=flush_interval,
                              repack=repack, draft=draft, speculative=speculative)
    finally:
        readiness.set(False)
        if server is not None:
            server.shutdown()
            server.server_close()


def _load_and_work(model: str, connection: Any, name: str, readiness: Readiness, metrics: Any, *,
                   threads: int | ThreadChoice | None, kv_budget: str | None, burst: bool, max_jobs: int | None,
                   heartbeat_interval: int, maintenance_interval: int, heartbeat_grace: int, engine: Any,
                   logging_level: str, flush_interval: float, repack: bool | None, draft: str | None,
                   speculative: str) -> bool:
    t0 = time.monotonic()
    if engine is None:
        choice = threads if isinstance(threads, ThreadChoice) else choose_threads(threads)
        engine = load_engine(model, choice.threads, kv_budget, repack=repack, draft=draft, speculative=speculative)
    else:
        choice = ThreadChoice(getattr(engine, "threads", 0), "the engine passed in")
    model_header.publish(connection, model, engine)  # a producer elsewhere counts tokens with it
    def new_worker() -> LLMWorker:
        w = LLMWorker(queue_names(model), model=model, name=name, connection=connection,
                      heartbeat_interval=heartbeat_interval, maintenance_interval=maintenance_interval,
                      heartbeat_grace=heartbeat_grace, kv_tokens=int(getattr(engine, "kv_capacity", 0) or 0))
        w.metrics = metrics
        return w

    worker = new_worker()
    runtime.set_context(runtime.WorkerContext(
        engine=JobEngine(engine), connection=connection, worker_name=worker.name,
        force_stop=worker.should_stop_generating, flush_interval=flush_interval,
        observe=metrics.observe if metrics is not None else None,
    ))
    if metrics is not None:
        metrics.set_kv_capacity(getattr(engine, "kv_capacity", 0))
    worker.log.info("Worker %s: model %s loaded in %.1f s; %d engine threads (%s); queues %s; %s",
                    worker.name, model, time.monotonic() - t0, choice.threads, choice.reason,
                    ", ".join(worker.queue_names()), describe_engine(engine))
    worked = False
    try:
        while True:
            readiness.set(True)
            try:
                worked = worker.work(burst=burst, max_jobs=max_jobs, logging_level=logging_level) or worked
            except REDIS_DOWN_ERRORS as e:  # teardown (register_death) with Redis away
                worker.redis_error = worker.redis_error or e
            if worker.redis_error is None or worker._stop_requested or worker.idle_exit or \
                    (max_jobs is not None and worker.jobs_run >= max_jobs):
                return worked
            # rq's loop quit because Redis stayed away longer than the client's retries: wait, go on.
            readiness.set(False)
            old = worker
            worker.log.error("Worker %s: lost Redis (%s); waiting for it", name, worker.redis_error)
            if not wait_for_redis(connection, stop=lambda: old._stop_requested, log=worker.log.warning):
                return worked
            connection.delete(old.key)  # our own stale registration (its teardown could not reach Redis)
            worker = new_worker()
            if max_jobs is not None:
                max_jobs -= old.jobs_run
            runtime.get_context().force_stop = worker.should_stop_generating
            worker.log.info("Worker %s: Redis is back; resuming", name)
    finally:
        runtime.set_context(None)

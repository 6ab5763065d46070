"""How a worker ends a job that did not succeed: refused, interrupted, Redis gone, or failed.

A mixin of LLMWorker (pipeline.worker). Its outcome goes to the ledger through jobs.outcomes, once:
a failure the task recorded itself (TaskFailed) is not recorded again; one rq decides on is.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rq.job import Job, JobStatus
from rq.job_lifecycle import call_exception_handlers
from rq.utils import now

from jobs.outcomes import record_rq_failure
from jobs.runtime import JobInterrupted, RedisUnavailable, TaskFailed

if TYPE_CHECKING:
    from pipeline.worker_metrics import WorkerMetrics


class JobEndings:
    """Overrides of rq's failure path (SimpleWorker has no hook between "the job raised" and "the job
    is failed"; rq's on_failure callback runs after the status is set and cannot requeue)."""

    _outcome_recorded: str | None = None  # the job whose failure its task recorded itself
    metrics: WorkerMetrics | None = None  # the worker's (--metrics-port); outcomes the task records count there too

    # rq (private job attributes): a refused job's callbacks must be cleared before rq's failure path would
    # import and call them; Job has no public way to drop a callback.
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

    # rq (private): the one step between "the job raised" and "the job is failed or retried"; a forced stop
    # or a Redis outage must requeue instead, and rq has no hook there (on_failure runs too late).
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
        if self.metrics is not None:
            self.metrics.ended("requeued")

    # rq: its handler logs a traceback for every failure; one the task recorded is one line.
    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        if exc_info and exc_info[0] is not None and issubclass(exc_info[0], TaskFailed):
            # An outcome the task already recorded (e.g. a request the engine refuses): one line, no traceback.
            self.log.warning("Worker %s: job %s failed: %s", self.name, job.id, exc_info[1])
            call_exception_handlers(self._exc_handlers, job, *exc_info)
            return
        super().handle_exception(job, *exc_info)

    # rq: failures rq decides on (refused, stopped, stuck) get no callback of ours; they reach the ledger here.
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
            if self.metrics is not None:
                self.metrics.ended(code)
            try:
                record_rq_failure(self.connection, job, code, why)
            except Exception:  # noqa: BLE001
                self.log.exception("Worker %s: could not record the failure of job %s", self.name, job.id)

"""The worker-side context tasks run in: the engine loaded once, the Redis connection, stop flags.

pipeline.worker installs a WorkerContext before its first job; task functions (jobs.tasks.*, and the
summariser's jobs.summarize_tasks.*) call `get_context()` for the engine and `run_generation()` to
generate with streaming, cooperative timeout and result recording.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rq import get_current_job

from jobs.ledger import Ledger
from jobs.outcomes import attempt_number, job_timeout, mark_final, record_failure, retries_left
from jobs.redis_conn import REDIS_DOWN_ERRORS
from jobs.schemas import GenerationJob, JobResult, TaskOptions
from jobs.streams import DEFAULT_STREAM_MAXLEN, TokenStreamWriter

if TYPE_CHECKING:
    from redis import Redis

log = logging.getLogger("rqllm.tasks")

class JobInterrupted(Exception):
    """The worker was told to stop right away (second SIGTERM/SIGINT); the job goes back to its queue."""


class RedisUnavailable(Exception):
    """Redis stayed unreachable (past the connection's retries) while a job ran: an outage, not the job's
    fault, so nothing is recorded and the worker puts the job back on its queue."""


class JobTimeout(Exception):
    """The job ran past its timeout (checked between tokens; rq's SIGALRM timeout is not used)."""


class TaskFailed(Exception):
    """A job ended failed; its JobResult (with the reason) is already recorded."""

    def __init__(self, result: JobResult):
        super().__init__(f"{result.error.code}: {result.error.message}" if result.error else "failed")
        self.result = result


@dataclass
class WorkerContext:
    engine: Any
    connection: Redis
    worker_name: str
    force_stop: Callable[[], bool] = lambda: False
    flush_interval: float = 0.05
    stream_maxlen: int = DEFAULT_STREAM_MAXLEN
    ledger: Ledger | None = None
    stats: dict[str, float] = field(default_factory=lambda: {"jobs": 0, "xadds": 0})
    # sees every outcome the task records, with the done job's prefill and decode tok/s (0.0 for a failure):
    # the worker's metrics (pipeline.worker_metrics)
    observe: Callable[[JobResult, float, float], None] | None = None

    def __post_init__(self) -> None:
        if self.ledger is None:
            self.ledger = Ledger(self.connection)


_context: WorkerContext | None = None


def set_context(ctx: WorkerContext | None) -> None:
    global _context
    _context = ctx


def get_context() -> WorkerContext:
    if _context is None:
        raise RuntimeError("rqllm tasks run only inside an rqllm worker (`rqllm worker --model ...`)")
    return _context


def run_current_job(job: GenerationJob, options: TaskOptions) -> JobResult:
    """run_generation() for the rq job being worked: its attempt number, timeout and retry rules, and
    its outcome recorded under the rq job id (what batches wait for; a summariser's map job runs a
    GenerationJob whose content id is not its rq id)."""
    rq_job = get_current_job()
    try:
        return run_generation(job, options, attempt=attempt_number(rq_job), timeout=job_timeout(rq_job),
                              retryable=lambda: retries_left(rq_job),
                              record_as=rq_job.id if rq_job is not None else None)
    except TaskFailed:
        mark_final(rq_job)  # recorded as final (e.g. a request the engine refuses)
        raise


def run_generation(job: GenerationJob, options: TaskOptions, *, attempt: int = 1,
                   timeout: float | None = None, retryable: Callable[[], bool] = lambda: False,
                   record_as: str | None = None) -> JobResult:
    """Generate one job with the worker's engine, streaming its text and recording its outcome.

    Returns the done JobResult. Raises JobInterrupted on a forced stop (nothing recorded: the job will
    run again), RedisUnavailable when Redis stayed away (nothing recorded: the job goes back on its queue),
    TaskFailed after recording a final failure, or the original exception unrecorded when `retryable()`
    says rq will run the job again. record_as: the id the stream and outcome go under (default job.id).
    """
    try:
        return _run_generation(job, options, attempt=attempt, timeout=timeout, retryable=retryable,
                               job_id=record_as or job.id)
    except REDIS_DOWN_ERRORS as e:
        # Not a job failure: recording one would end the job for its batches while the outage is the cause.
        raise RedisUnavailable(f"{type(e).__name__}: {e}") from e


def _run_generation(job: GenerationJob, options: TaskOptions, *, attempt: int, timeout: float | None,
                    retryable: Callable[[], bool], job_id: str) -> JobResult:
    from engine.engine import EngineError, EngineInterrupted  # the engine loads only in a worker

    ctx = get_context()
    writer = TokenStreamWriter(ctx.connection, job_id, ttl=options.stream_ttl, maxlen=ctx.stream_maxlen,
                               interval=ctx.flush_interval)
    started = time.time()
    attempt = writer.start(attempt, ctx.worker_name)  # counts runs lost with a dead worker too
    deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
    timed_out = False

    def should_stop() -> bool:
        nonlocal timed_out
        if ctx.force_stop():
            return True
        if deadline is not None and time.monotonic() > deadline:
            timed_out = True
            return True
        return False

    common = dict(model=job.model, endpoint=job.endpoint, worker=ctx.worker_name, attempt=attempt,
                  started_at=started)

    def fail(code: str, message: str) -> TaskFailed:
        result, _ = record_failure(ctx.ledger, job_id, code, message, options=options, only_if_absent=False,
                                   last_text=writer.take(), stream_maxlen=ctx.stream_maxlen, **common)
        if ctx.observe is not None:
            ctx.observe(result, 0.0, 0.0)
        return TaskFailed(result)  # the worker logs its one line (pipeline.job_endings)

    try:
        gen = ctx.engine.generate(
            prompt=job.prompt,
            messages=[m.model_dump(exclude_none=True) for m in job.messages] if job.messages is not None else None,
            params=job.params,
            on_text=writer.add,
            should_stop=should_stop,
            owner=job.owner,  # the KV prefix of one API key's prompt is never reused for another's
        )
    except EngineInterrupted:
        if timed_out and not ctx.force_stop():
            message = f"job exceeded its timeout of {timeout:g} s"
            if retryable():
                writer.mark({"type": "retry", "error": message})
                raise JobTimeout(message) from None
            raise fail("timeout", message) from None
        writer.mark({"type": "interrupted"})
        raise JobInterrupted(job_id) from None
    except EngineError as e:
        # A bad request fails the same way every time: no retry.
        raise fail("invalid_request", str(e)) from None
    except REDIS_DOWN_ERRORS:
        raise  # streaming a chunk hit a Redis outage: not the job's failure
    except Exception as e:  # noqa: BLE001 - any engine/runtime failure is recorded with its reason
        if retryable():
            writer.mark({"type": "retry", "error": f"{type(e).__name__}: {e}"})
            raise
        raise fail("worker_error", f"{type(e).__name__}: {e}") from None

    result = JobResult.from_generation(job, gen, job_id=job_id, **common)
    ctx.ledger.finish(result, result_ttl=options.result_ttl, stream_ttl=options.stream_ttl,
                      last_text=writer.take(), stream_maxlen=ctx.stream_maxlen)
    # The worker's one line per job (rq's own lines per job are at DEBUG: pipeline.worker). For operators:
    # API clients do not see these (they would describe other tenants' work).
    log.info("job %s done on %s: %d tokens in (%d from the prefix cache), %d out; prefill %.3f s (%.0f tok/s), "
             "decode %.3f s (%.1f tok/s)%s", job_id, ctx.worker_name, gen.prompt_tokens, gen.prefix_hit_tokens,
             gen.completion_tokens, gen.prefill_seconds, gen.prefill_tps, gen.decode_seconds, gen.decode_tps,
             f"; {gen.accepted_tokens} of {gen.draft_tokens} guesses kept" if gen.draft_tokens else "")
    if ctx.observe is not None:
        ctx.observe(result, gen.prefill_tps, gen.decode_tps)
    ctx.stats["jobs"] += 1
    ctx.stats["xadds"] += writer.xadds
    return result

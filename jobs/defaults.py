"""Defaults of the jobs layer (queues, job lifetimes, rq's job states): one place to change them."""
from __future__ import annotations

from typing import Literal, get_args

from rq.job import JobStatus

# Queues, highest first: a worker drains "high" before "default" before "low".
Priority = Literal["high", "default", "low"]
PRIORITIES: tuple[str, ...] = get_args(Priority)
DEFAULT_PRIORITY = "default"

# Seconds a job may run before the worker fails it (checked between tokens); the worker Deployment's
# terminationGracePeriodSeconds must cover it, so a rollout lets a running job end.
JOB_TIMEOUT = 1800
# How long a finished job's result, and its token stream, stay readable in Redis.
RESULT_TTL = 7 * 24 * 3600
STREAM_TTL = 24 * 3600

# rq job states in which the job may still run (rq.job.JobStatus); any other state means it ended.
WAITING_STATUSES: frozenset[str] = frozenset({JobStatus.QUEUED.value, JobStatus.DEFERRED.value,
                                              JobStatus.SCHEDULED.value})
ACTIVE_STATUSES: frozenset[str] = WAITING_STATUSES | {JobStatus.STARTED.value}

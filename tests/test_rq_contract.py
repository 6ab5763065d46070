"""What rqllm relies on inside rq, checked against the installed rq: an rq release that renames,
re-signs or drops any of it fails here, loudly, instead of the worker misbehaving quietly.

LLMWorker (pipeline.worker, pipeline.job_endings) overrides rq methods whose callers are rq's own
work loop, and reads a few private attributes; the reaper (pipeline.recovery) and the dequeue
(pipeline.dequeue) use rq's registries and intermediate lists. Each override's comment says why rq's
public API does not serve.
"""
from __future__ import annotations

import inspect

import pytest
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.registry import StartedJobRegistry

from jobs.schemas import queue_names
from pipeline.job_endings import JobEndings
from pipeline.worker import LLMWorker
from tests.conftest_redis import client, redis_conn, redis_server, redis_url  # noqa: F401

M = "smollm2-135m"

# Methods of rq's SimpleWorker that LLMWorker replaces; rq's work loop calls them, so a rename would
# silently bypass ours.
OVERRIDDEN = [
    "teardown", "serialize", "_install_signal_handlers", "dequeue_job_and_maintain_ttl", "heartbeat",
    "clean_registries", "check_for_suspension", "run_maintenance_tasks", "get_heartbeat_ttl",
    "prepare_job_execution", "execute_job", "_finalize_failure", "handle_exception", "handle_job_failure",
]
# rq methods our overrides call (through super() or directly) with these parameters.
CALLED = {
    "maintain_heartbeats": ["job", "execution"],
    "prepare_execution": ["job"],
    "perform_job": ["job", "queue", "execution"],
    "cleanup_execution": ["job", "pipeline", "execution"],
    "handle_job_failure": ["job", "queue", "started_job_registry", "exc_string", "execution"],
    "prepare_job_execution": ["job", "remove_from_intermediate_queue"],
    "heartbeat": ["timeout", "pipeline"],
    "get_heartbeat_ttl": ["job", "working_time"],
}


def _params(func) -> list[str]:
    return [p for p in inspect.signature(func).parameters if p != "self"]


@pytest.mark.parametrize("name", OVERRIDDEN)
def test_every_override_still_overrides_an_rq_method_with_the_same_parameters(name):
    ours = LLMWorker.__dict__.get(name) or JobEndings.__dict__.get(name)
    assert ours is not None, f"LLMWorker no longer overrides {name}: drop it from this list"
    theirs = getattr(SimpleWorker, name, None)
    assert theirs is not None, f"rq's SimpleWorker has no {name} any more: LLMWorker's override is dead code"
    assert _params(ours) == _params(theirs), f"rq changed the parameters of {name}"


@pytest.mark.parametrize("name,params", sorted(CALLED.items()))
def test_the_rq_methods_our_overrides_call_keep_their_parameters(name, params):
    assert _params(getattr(SimpleWorker, name)) == params


def test_the_private_attributes_we_read_are_still_there(client):
    w = LLMWorker(queue_names(M), model=M, connection=client.connection, name="contract")
    # signal flags rq's loop reads, the stop-job command's note, exception handlers, queue order
    for attr in ("_stop_requested", "_shutdown_requested_date", "_stopped_job_id", "_exc_handlers",
                 "_ordered_queues"):
        assert hasattr(w, attr), f"rq's worker has no {attr} any more"
    job = Job.create("jobs.tasks.generate", args=({}, {}), connection=client.connection)
    for attr in ("_success_callback_name", "_failure_callback_name", "_stopped_callback_name",
                 "_success_callback", "_failure_callback", "_stopped_callback", "webhooks", "retries_left",
                 "number_of_retries", "timeout"):
        assert hasattr(job, attr), f"rq's Job has no {attr} any more (the refusal path clears callbacks)"
    q = Queue(queue_names(M)[0], connection=client.connection)
    for attr in ("intermediate_queue_key", "registry_cleaning_key", "intermediate_queue"):
        assert hasattr(q, attr), f"rq's Queue has no {attr} any more"
    assert _params(Queue.push_job_id) == ["job_id", "pipeline", "at_front"]
    assert "death_penalty_class" in inspect.signature(StartedJobRegistry).parameters
    assert "exception_handlers" in inspect.signature(StartedJobRegistry.cleanup).parameters
    assert callable(getattr(StartedJobRegistry, "get_expired_job_ids", None))
    from rq.job_lifecycle import call_exception_handlers  # noqa: F401 - handle_exception calls it


def test_rq_work_loop_dequeues_through_our_method(client):
    """The loss-free dequeue only works if rq's loop asks dequeue_job_and_maintain_ttl for jobs."""
    source = inspect.getsource(SimpleWorker.work)
    assert "dequeue_job_and_maintain_ttl" in source

"""LLMWorker's parts that need no engine: priority pop into intermediate lists, TTLs, signal flags,
token-stream chunk batching. Real Redis, real rq objects."""
from __future__ import annotations

import json
import signal
from datetime import timedelta

from jobs import keys
from jobs import ledger as ledger_module
from jobs.ledger import Ledger
from jobs.schemas import JobResult, queue_names
from jobs import streams
from jobs.streams import TokenStreamWriter, final_text, read_all
from pipeline.worker import LLMWorker
from tests.conftest_redis import client, redis_conn, redis_server, redis_url  # noqa: F401

M = "smollm2-135m"


def one(client, tag, prio):
    bid = client.submit_batch([{"model": M, "prompt": f"Say {tag}.", "params": {"max_tokens": 2}}], priority=prio)
    return client.batch_entries(bid)[0][1]


def test_pop_in_priority_order_into_intermediate_lists(client):
    low, d1, high, d2 = one(client, "low", "low"), one(client, "d1", "default"), one(client, "hi", "high"), \
        one(client, "d2", "default")
    w = LLMWorker(queue_names(M), model=M, connection=client.connection, name="pop-test")
    order = []
    while (got := w.pop_job()) is not None:
        job, queue = got
        order.append(job.id)
        assert client.connection.lrange(queue.intermediate_queue_key, 0, -1) == [job.id.encode()]
        assert job.func_name == "jobs.tasks.generate" and job.origin == queue.name
        client.connection.lrem(queue.intermediate_queue_key, 1, job.id)
    assert order == [high, d1, d2, low]


def test_pop_skips_deleted_jobs(client):
    a, b = one(client, "a", "default"), one(client, "b", "default")
    client.connection.delete(f"rq:job:{a}")
    w = LLMWorker(queue_names(M), model=M, connection=client.connection, name="pop-test2")
    job, queue = w.pop_job()
    assert job.id == b
    assert client.connection.lrange(queue.intermediate_queue_key, 0, -1) == [b.encode()]


def test_heartbeat_ttl_and_signal_flags(client):
    w = LLMWorker(queue_names(M), model=M, connection=client.connection, name="sig-test",
                  heartbeat_interval=3, heartbeat_grace=5)
    job = client.queue(M).enqueue("jobs.tasks.generate", {}, job_timeout=600)
    assert w.get_heartbeat_ttl(job) == 8  # interval + grace, not timeout + 60
    w._on_signal(signal.SIGTERM, None)
    assert w._stop_requested and not w._force_stop and not w.should_stop_generating()
    w._on_signal(signal.SIGTERM, None)  # same signal twice within a second: ignored
    assert not w._force_stop
    w._shutdown_requested_date -= timedelta(seconds=2)
    w._on_signal(signal.SIGINT, None)
    assert w._force_stop and w.should_stop_generating()
    w.register_birth()
    assert client.connection.hget(w.key, "rqllm_model") == M.encode()
    w.register_death()


def test_token_stream_batches_chunks_by_time(redis_conn):
    t = [0.0]
    wr = TokenStreamWriter(redis_conn, "gx", ttl=60, interval=0.05, clock=lambda: t[0])
    wr.start(1, "w")
    for i in range(10):  # 10 pieces within one interval -> one chunk
        wr.add(f"a{i} ")
        t[0] += 0.004
    t[0] += 0.02
    wr.add("b ")  # interval passed -> flush
    wr.add("c")
    entries = read_all(redis_conn, keys.token_stream_key("gx"))
    assert [e.type for e in entries] == ["start", "text"]
    assert wr.take() == "c"
    assert final_text(entries) == "".join(f"a{i} " for i in range(10)) + "b "
    assert 0 < redis_conn.ttl(keys.token_stream_key("gx")) <= 60
    wr.start(2, "w")  # a rerun drops the earlier text
    assert [e.type for e in read_all(redis_conn, keys.token_stream_key("gx"))] == ["start"]


def test_token_stream_append_retried_after_a_lost_reply_is_written_once(redis_conn):
    """A dropped connection makes redis-py resend the append it may already have applied (seen as
    doubled text after a Redis restart): the same write must land once, the next one still lands."""
    wr = TokenStreamWriter(redis_conn, "gy", ttl=60)
    wr.start(1, "w")
    key = keys.token_stream_key("gy")
    wr.append({"type": "text", "text": "The number "})
    resent = [wr.write_id(), json.dumps({"type": "text", "text": "The number "}), 1000]
    redis_conn.register_script(streams._APPEND)(keys=[key], args=resent)  # the retry, same args
    wr.append({"type": "text", "text": "3"})
    entries = read_all(redis_conn, key)
    assert [e.type for e in entries] == ["start", "text", "text"]
    assert final_text(entries) == "The number 3"


def test_finish_resent_after_a_lost_reply_writes_the_last_text_and_end_marker_once(redis_conn):
    """The end-of-job script is resent like any command whose reply a Redis restart lost: the replay,
    with the very same arguments, must not append the last text and the end marker a second time (nor
    tell the batches twice); a later finish call is a new write and still lands."""
    wr = TokenStreamWriter(redis_conn, "gf", ttl=60)
    wr.start(1, "w")
    wr.append({"type": "text", "text": "The number "})
    redis_conn.sadd(keys.job_batches_key("gf"), "bf")
    redis_conn.hset(keys.batch_key("bf"), mapping={"total": 1, "done": 0})
    redis_conn.expire(keys.batch_key("bf"), 60)

    ledger = Ledger(redis_conn)
    sent = []
    script = ledger._finish
    ledger._finish = lambda **kw: sent.append(kw) or script(**kw)  # what redis-py would resend
    result = JobResult(job_id="gf", status="done", model=M, endpoint="/v1/completions", text="The number 3.",
                       finish_reason="stop", prompt_tokens=4, completion_tokens=3)
    assert ledger.finish(result, result_ttl=60, stream_ttl=60, last_text="3.") == 1
    assert redis_conn.register_script(ledger_module._FINISH)(**sent[0]) == 0  # the resend

    stream = keys.token_stream_key("gf")
    entries = read_all(redis_conn, stream)
    assert [e.type for e in entries] == ["start", "text", "text", "end"]
    assert final_text(entries) == "The number 3."
    assert int(redis_conn.hget(keys.batch_key("bf"), "done")) == 1
    assert redis_conn.xlen(keys.batch_events_key("bf")) == 1
    ledger._finish = script
    ledger.finish(result, result_ttl=60, stream_ttl=60)  # a new call, not a resend
    assert [e.type for e in read_all(redis_conn, stream)][-2:] == ["end", "end"]


def test_a_failure_its_task_recorded_is_not_recorded_again(client):
    """The task records its own failure (TaskFailed), then rq's bookkeeping runs. A producer may clear that
    failed result in between (a resubmission re-runs the job): the worker must not then write a second,
    spurious failure (worker_error) that the new run's waiters would get. Other errors are still recorded."""
    from jobs.runtime import TaskFailed

    bid = client.submit_batch([{"model": M, "prompt": f"Say {w}.", "custom_id": w, "params": {"max_tokens": 2}}
                               for w in ("a", "b")])
    ids = dict(client.batch_entries(bid))
    w = LLMWorker(queue_names(M), model=M, connection=client.connection, name="outcome-test")
    for exc in (TaskFailed(JobResult.failed(ids["a"], "invalid_request", "too long", model=M)),
                RuntimeError("engine exploded")):
        job, queue = w.pop_job()
        execution = w.prepare_execution(job)
        w.prepare_job_execution(job, remove_from_intermediate_queue=True)
        w._finalize_failure(job, queue, execution, (type(exc), exc, None))
        assert client.job_status(job.id) == "failed"
    assert client.result(ids["a"]) is None  # its task's record was cleared; nothing spurious replaced it
    assert client.result(ids["b"]).error.code == "worker_error"
    assert "engine exploded" in client.result(ids["b"]).error.message

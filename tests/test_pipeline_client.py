"""Client against a real Redis (no worker): batches, content-id reuse, priorities, reconcile, no pickle."""
from __future__ import annotations

import json

import pytest
from rq import Queue
from rq.job import Job

from jobs import keys
from jobs.ledger import Ledger
from jobs.schemas import InvalidJob, JobResult, queue_name
from pipeline.client import Client
from jobs.redis_conn import SERIALIZER
from tests.conftest_redis import assert_no_pickle, client, redis_conn, redis_server, redis_url  # noqa: F401

M = "smollm2-135m"


def jobs(n, **params):
    return [{"model": M, "prompt": f"Count to {i}", "custom_id": f"c{i}", "params": {"max_tokens": 8, **params}}
            for i in range(n)]


def finish(c: Client, job_id: str, status="done", text="ok"):
    """Record an outcome the way a worker does (jobs.ledger.Ledger.finish)."""
    if status == "done":
        r = JobResult(job_id=job_id, status="done", model=M, text=text, finish_reason="length",
                      completion_tokens=3, worker="t")
    else:
        r = JobResult.failed(job_id, "invalid_request", "too long", model=M)
    return Ledger(c.connection).finish(r, result_ttl=600, stream_ttl=600)


def test_submit_batch_records_and_enqueues(client):
    bid = client.submit_batch(jobs(5), priority="default", timeout=60, retries=2)
    st = client.batch_status(bid)
    assert (st.total, st.requests, st.done, st.failed, st.pending) == (5, 5, 0, 0, 5)
    assert st.models == [M] and st.priority == "default"
    entries = client.batch_entries(bid)
    assert [c for c, _ in entries] == [f"c{i}" for i in range(5)]
    q = Queue(queue_name(M), connection=client.connection, serializer=SERIALIZER)
    assert q.count == 5 and q.key == f"rq:queue:rqllm:{M}:default"
    j = Job.fetch(entries[0][1], connection=client.connection, serializer=SERIALIZER)
    assert j.func_name == "jobs.tasks.generate"
    assert j.args[0]["prompt"] == "Count to 0" and j.args[0]["id"] == entries[0][1]
    assert j.timeout == 60 and j.retries_left == 2
    assert j.meta == {"batch_id": bid, "custom_id": "c0"}
    assert client.last_report.enqueued == 5
    assert client.connection.llen(keys.doorbell_key(M)) > 0
    counts = assert_no_pickle(client.connection)
    assert counts.get("zlib-json", 0) >= 5  # rq job data, JSON inside zlib


def test_priority_queues(client):
    client.submit_batch(jobs(2), priority="high")
    client.submit_batch(jobs(1, temperature=0.0, seed=5), priority="low")
    names = {q.name: q.count for q in client.queues()}
    assert names == {f"rqllm:{M}:high": 2, f"rqllm:{M}:low": 1}
    with pytest.raises(InvalidJob):
        client.submit_batch(jobs(1), priority="urgent")


def test_invalid_batch_refused_entirely(client, redis_conn):
    bad = jobs(3)
    bad[1]["params"]["temperature"] = -1
    with pytest.raises(InvalidJob) as e:
        client.submit_batch(bad)
    assert "job 2 (c1)" in str(e.value) and "temperature" in str(e.value)
    assert redis_conn.dbsize() == 0
    dup = jobs(2)
    dup[1]["custom_id"] = "c0"
    with pytest.raises(InvalidJob, match="more than once"):
        client.submit_batch(dup)


def test_same_content_shares_one_job(client):
    js = jobs(1) + [{**jobs(1)[0], "custom_id": "again"}]
    bid = client.submit_batch(js)
    st = client.batch_status(bid)
    assert st.requests == 2 and st.total == 1
    assert client.queue(M).count == 1
    e = client.batch_entries(bid)
    assert e[0][1] == e[1][1]


def test_resubmission_reuses_finished_results(client):
    bid = client.submit_batch(jobs(3))
    ids = [j for _, j in client.batch_entries(bid)]
    assert finish(client, ids[0]) == 1  # one batch told
    assert finish(client, ids[1], status="failed") == 1
    st = client.batch_status(bid)
    assert (st.done, st.failed, st.pending) == (1, 1, 1)
    evs = [e.data for e in client.events(bid)]
    assert evs[0]["type"] == "created"
    assert {"job": ids[0], "status": "done"} in evs and {"job": ids[1], "status": "failed"} in evs

    # A second batch while job 2 is still queued: done reused, failed re-enqueued, queued joined.
    client.connection.hset(Job.key_for(ids[0]), "status", "finished")  # as rq would have it
    client.connection.hset(Job.key_for(ids[1]), "status", "failed")
    bid2 = client.submit_batch(jobs(3))
    rep = client.last_report
    assert (rep.cached, rep.enqueued, rep.joined) == (1, 1, 1)
    st2 = client.batch_status(bid2)
    assert (st2.done, st2.cached, st2.pending) == (1, 1, 2)
    assert client.result(ids[1]) is None  # the stale failure was dropped when it was re-enqueued
    # The queued job ends once and both waiting batches hear about it.
    assert finish(client, ids[2]) == 2
    assert client.batch_status(bid).done == 2 and client.batch_status(bid2).done == 2

    bid3 = client.submit_batch(jobs(3), recompute=True)
    # job 0 finished -> computed again; jobs 1 and 2 are still queued in rq -> joined
    assert client.last_report.enqueued == 1 and client.last_report.joined == 2
    assert client.batch_status(bid3).cached == 0
    assert_no_pickle(client.connection)


def test_reconcile_records_lost_and_canceled_jobs(client):
    bid = client.submit_batch(jobs(3))
    ids = [j for _, j in client.batch_entries(bid)]
    client.connection.delete(Job.key_for(ids[0]))  # vanished from Redis
    j = Job.fetch(ids[1], connection=client.connection, serializer=SERIALIZER)
    j.cancel()
    assert client.reconcile(bid, grace=0.05) == 2
    res = dict(client.results(bid))
    assert res["c0"].error.code == "lost"
    assert res["c1"].error.code == "canceled"
    assert res["c2"] is None  # still queued: left alone
    assert client.batch_status(bid).failed == 2
    assert client.reconcile(bid, grace=0.05) == 0


def test_submit_single_job_and_wait(client):
    jid = client.submit({"model": M, "prompt": "Hi"})
    assert client.job_status(jid) == "queued"
    finish(client, jid, text="hello")
    assert client.wait(jid, timeout=5).text == "hello"
    assert client.submit({"model": M, "prompt": "Hi"}) == jid
    assert client.last_report.cached == 1

"""Faults: a worker SIGKILLed mid-job, a job id orphaned between pop and start, Redis restarted mid-batch.

Real Redis, real rq objects, real worker processes running SmolLM2-135M (the engine tests skip without
it). The long version - 500 jobs, 3 workers, three kills, a Redis restart, a collector kill - is
`python -m bench.fault_injection`.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from rq.job import Job

from bench.fault_injection import AofRedis
from jobs import keys
from jobs.schemas import queue_names
from pipeline.client import Client
from pipeline.collector import collect
from pipeline.embedded import WorkerProcess, stop_workers, worker_argv
from jobs.redis_conn import SERIALIZER
from jobs.streams import final_text, follow_tokens, read_all
from jobs.keys import popped_key
from pipeline.recovery import WORKER_LOSS_RETRIES, Reaper
from pipeline.worker import LLMWorker
from tests.conftest_redis import (  # noqa: F401
    client,
    redis_conn,
    redis_server,
    redis_url,
    spawn_worker,
    wait_for_workers,
)
from tests.model_available import needs_model

M = "smollm2-135m"
LONG_PROMPT = "Count from 1 to 1000: 1, 2, 3, 4, 5,"  # the model keeps counting until max_tokens


needs_engine = needs_model(M)


# ---------------------------------------------------------------- reaper, no engine
def _start_and_die(client: Client, name: str) -> Job:
    """What a worker does up to running the task, then nothing more (as if SIGKILLed)."""
    w = LLMWorker(queue_names(M), model=M, connection=client.connection, name=name)
    job, queue = w.pop_job()
    w.prepare_execution(job)
    w.prepare_job_execution(job, remove_from_intermediate_queue=True)
    return job


def _expire_started(client: Client) -> None:
    """Jump past the heartbeat TTL: every started-registry entry is now overdue."""
    q = client.queue(M)
    for member in client.connection.zrange(q.started_job_registry.key, 0, -1):
        client.connection.zadd(q.started_job_registry.key, {member: 1})


def test_reaper_retries_a_dead_workers_job_at_the_front_then_fails_it(client):
    bid = client.submit_batch([{"model": M, "prompt": "Say hi.", "custom_id": "a", "params": {"max_tokens": 2}},
                               {"model": M, "prompt": "Say bye.", "custom_id": "b", "params": {"max_tokens": 2}}])
    ids = dict(client.batch_entries(bid))
    q = client.queue(M)
    job = _start_and_die(client, "dead-1")
    assert job.id == ids["a"] and client.job_status(job.id) == "started"
    reaper = Reaper(client.connection, queue_names(M), name="test-reaper", restart_grace=0)
    assert reaper.run() == []  # entry not expired yet: a live job is left alone
    _expire_started(client)
    # right after a Redis restart every entry looks overdue (nobody could beat): wait for live workers
    assert Reaper(client.connection, queue_names(M), name="r", restart_grace=1e9).run() == []
    assert client.job_status(job.id) == "started"

    for loss in range(1, WORKER_LOSS_RETRIES + 1):
        _expire_started(client)
        acted = reaper.run()
        assert acted == [(job.id, f"worker lost ({loss}x): queued")]
        assert client.job_status(job.id) == "queued"
        assert q.get_job_ids()[0] == job.id  # at the front, not behind the rest of the batch
        assert client.result(job.id) is None
        assert _start_and_die(client, f"dead-{loss + 1}").id == job.id

    _expire_started(client)
    acted: list = []
    # as from a busy worker's heartbeat thread: rq's failure callback must still run (no SIGALRM there)
    t = threading.Thread(target=lambda: acted.extend(reaper.run()))
    t.start()
    t.join()
    assert acted == [(job.id, f"worker lost ({WORKER_LOSS_RETRIES + 1}x): failed")]
    r = client.result(job.id)
    assert r.status == "failed" and r.error.code == "worker_lost" and "stopped responding" in r.error.message
    st = client.batch_status(bid)
    assert (st.done, st.failed) == (0, 1)
    assert q.get_job_ids() == [ids["b"]]  # the other job is untouched


def test_reaper_requeues_a_job_popped_by_a_worker_that_died_before_starting_it(client):
    jid = client.submit({"model": M, "prompt": "Say hi.", "params": {"max_tokens": 2}})
    q = client.queue(M)
    w = LLMWorker(queue_names(M), model=M, connection=client.connection, name="popper")
    job, _ = w.pop_job()  # ... and dies here: the id is only in the intermediate list
    assert q.get_job_ids() == [] and client.connection.lrange(q.intermediate_queue_key, 0, -1) == [jid.encode()]
    reaper = Reaper(client.connection, queue_names(M), name="test-reaper", restart_grace=0)
    assert reaper.run() == []  # the popped mark is still alive: the worker may be about to start it
    client.connection.delete(popped_key(jid))  # the mark expired
    assert reaper.run() == [(jid, "requeued (popped, never started)")]
    assert q.get_job_ids() == [jid] and client.connection.llen(q.intermediate_queue_key) == 0
    assert reaper.run() == []  # nothing twice


def test_collector_recovers_a_dead_workers_job_when_no_worker_is_free(client, tmp_path):
    """The collector runs the reaper too: with every worker busy (here: none at all), the job of a dead
    worker still goes back to its queue; once it ends, the collector writes it."""
    from jobs.ledger import Ledger
    from jobs.schemas import JobResult

    bid = client.submit_batch([{"model": M, "prompt": "Say hi.", "custom_id": "a", "params": {"max_tokens": 2}}])
    job = _start_and_die(client, "dead-c")
    _expire_started(client)
    reaper = Reaper(client.connection, queue_names(M), name="collector-reaper", restart_grace=0, interval=0.2)
    summary: dict = {}
    t = threading.Thread(target=lambda: summary.update(
        s=collect(client, bid, tmp_path / "o.jsonl", progress=False, timeout=30, block_ms=100, reaper=reaper)))
    t.start()
    deadline = time.monotonic() + 20
    while client.job_status(job.id) != "queued":
        assert time.monotonic() < deadline, "the collector did not requeue the dead worker's job"
        time.sleep(0.02)
    assert client.queue(M).get_job_ids() == [job.id]
    Ledger(client.connection).finish(
        JobResult(job_id=job.id, status="done", model=M, endpoint="/v1/completions", text="hi",
                  finish_reason="stop", prompt_tokens=3, completion_tokens=1), result_ttl=600, stream_ttl=600)
    t.join(30)
    assert summary["s"].done == 1


def test_reaper_passes_never_overlap_and_a_dead_holders_lock_expires(client):
    reaper = Reaper(client.connection, queue_names(M), name="r1")
    q = client.queue(M)
    with reaper.locked(q) as got:
        assert got
        with Reaper(client.connection, queue_names(M), name="r2").locked(q) as got2:
            assert not got2
    ttl = None
    with reaper.locked(q):
        ttl = client.connection.ttl(q.registry_cleaning_key)
    assert 0 < ttl <= 10  # rq's own lock would hold for 899 s if its holder were killed


# ---------------------------------------------------------------- real workers
def _running_worker(client: Client, jid: str, names: list[str]) -> str:
    name = client.connection.hget(Job.key_for(jid), "worker_name").decode()
    assert name in names
    return name


@needs_engine
def test_sigkilled_worker_job_is_retried_within_60s_without_the_dead_runs_text(client, spawn_worker):
    """Default worker settings: the job of a SIGKILLed worker runs again on the other worker within
    60 s, its result is the retried run's, and the stream (as a follower sees it) restarts cleanly."""
    w1, w2 = spawn_worker(name="fk-w1"), spawn_worker(name="fk-w2")
    wait_for_workers(client.connection, [w1.name, w2.name])
    bid = client.submit_batch([{"model": M, "prompt": LONG_PROMPT, "custom_id": "long",
                                "params": {"max_tokens": 60}}])  # no --retries: worker loss has its own
    jid = client.batch_entries(bid)[0][1]
    followed: list = []
    follower = threading.Thread(target=lambda: followed.extend(follow_tokens(client.connection, jid)), daemon=True)
    follower.start()
    tkey = keys.token_stream_key(jid)
    deadline = time.monotonic() + 120
    while sum(e.type == "text" for e in read_all(client.connection, tkey)) < 2:
        assert time.monotonic() < deadline, "the job did not start generating"
        time.sleep(0.01)
    by_name = {w1.name: w1, w2.name: w2}
    victim = by_name.pop(_running_worker(client, jid, list(by_name)))
    survivor = next(iter(by_name.values()))
    victim.proc.kill()
    t_kill = time.monotonic()
    victim.proc.wait()
    dead_text = final_text(read_all(client.connection, tkey))
    assert dead_text and client.result(jid) is None

    def rerun_started() -> bool:
        entries = read_all(client.connection, tkey)
        return bool(entries) and entries[0].type == "start" and entries[0].data.get("attempt") == 2

    while not rerun_started():
        assert time.monotonic() - t_kill < 60, "the dead worker's job was not retried within 60 s"
        time.sleep(0.05)
    s = collect(client, bid, Path(survivor.log_path).with_suffix(".jsonl"), progress=False, timeout=120)
    assert s.done == 1
    r = client.result(jid)
    assert r.status == "done" and r.worker == survivor.name and r.attempt == 2
    # greedy decoding: the rerun starts with the same text; it appears once, not dead run + rerun
    assert r.text.startswith(dead_text) and r.text.count(dead_text) == 1
    entries = read_all(client.connection, tkey)
    assert [e.data.get("attempt") for e in entries if e.type == "start"] == [2]
    assert final_text(entries) == r.text
    follower.join(10)
    starts = [e.data for e in followed if e.type == "start"]
    assert [(d["attempt"], d["worker"]) for d in starts] == [(1, victim.name), (2, survivor.name)]
    assert followed[-1].type == "end" and final_text(followed) == r.text
    assert survivor.alive()


@needs_engine
def test_redis_restart_mid_batch_loses_nothing(tmp_path):
    """Redis (AOF on) restarted on the same port while a worker generates: the worker and the collector
    reconnect on their own, every job ends done, the worker is still running."""
    server = AofRedis(data_dir=str(tmp_path / "redis")).start()
    client = Client(server.url)
    w = WorkerProcess(worker_argv(server.url, M, threads=1, name="rr-w1"), str(tmp_path / "rr-w1.log"))
    try:
        wait_for_workers(client.connection, ["rr-w1"])
        n = 12
        bid = client.submit_batch([{"model": M, "custom_id": f"j{i}", "params": {"max_tokens": 12},
                                    "messages": [{"role": "user", "content": f"Say the number {i}."}]}
                                   for i in range(n)])
        summary: dict = {}
        out = tmp_path / "out.jsonl"
        collector = threading.Thread(
            target=lambda: summary.update(s=collect(Client(server.url), bid, out, progress=False, timeout=180)))
        collector.start()
        deadline = time.monotonic() + 120
        while client.batch_status(bid).done < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert client.batch_status(bid).done < n
        server.shutdown()  # SIGTERM: AOF fsynced, clients disconnected mid-whatever
        time.sleep(1.5)
        server.start()
        collector.join(200)
        s = summary["s"]
        assert (s.written, s.done, s.failed) == (n, n, 0)
        got = [line for line in out.read_text().splitlines() if line.strip()]
        assert len(got) == n
        assert w.alive(), w.tail()
        st = client.batch_status(bid)
        assert (st.done, st.failed) == (n, 0)
        for _, r in client.results(bid):
            assert final_text(read_all(client.connection, keys.token_stream_key(r.job_id))) == r.text
        # nothing is stranded in rq's bookkeeping either
        q = client.queue(M)
        assert q.count == 0 and q.started_job_registry.get_job_ids(cleanup=False) == []
        assert Job.fetch(r.job_id, connection=client.connection, serializer=SERIALIZER).get_status() == "finished"
    finally:
        stop_workers([w])
        server.stop()


@needs_engine
@pytest.mark.slow
def test_redis_down_longer_than_the_client_retries_mid_job(tmp_path):
    """Redis gone for 40 s (longer than the ~30 s the connection retries) while a job generates: the job is
    not recorded failed (an outage is not the job's fault), it goes back to its queue and runs again, the
    worker keeps going and the collector waits; every job ends done."""
    server = AofRedis(data_dir=str(tmp_path / "redis")).start()
    client = Client(server.url)
    w = WorkerProcess(worker_argv(server.url, M, threads=1, name="ro-w1"), str(tmp_path / "ro-w1.log"))
    try:
        wait_for_workers(client.connection, ["ro-w1"])
        n = 3
        bid = client.submit_batch([{"model": M, "custom_id": f"j{i}", "params": {"max_tokens": 400},
                                    "prompt": f"Count from {i} to 1000: {i}, {i + 1},"} for i in range(n)])
        summary: dict = {}
        collector = threading.Thread(target=lambda: summary.update(
            s=collect(Client(server.url), bid, tmp_path / "out.jsonl", progress=False, timeout=400)))
        collector.start()
        first = client.batch_entries(bid)[0][1]
        deadline = time.monotonic() + 120
        while not any(e.type == "text" for e in read_all(client.connection, keys.token_stream_key(first))):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.shutdown()
        time.sleep(40)
        server.start()
        collector.join(400)
        s = summary["s"]
        assert (s.written, s.done, s.failed) == (n, n, 0)
        assert w.alive(), w.tail()
        assert f"job {first} requeued (Redis unavailable" in Path(w.log_path).read_text()
        assert client.result(first).attempt == 2
        for _, r in client.results(bid):
            assert final_text(read_all(client.connection, keys.token_stream_key(r.job_id))) == r.text
    finally:
        stop_workers([w])
        server.stop()

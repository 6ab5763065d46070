"""End to end with a real Redis, real worker processes and the real engine running SmolLM2-135M.

No mocks: jobs go through rq (JSON serializer) into `python -m pipeline.cli_worker` processes (the same
command as `rqllm worker`), which generate with engine.Engine and stream into Redis.
max_tokens stays small so the suite is quick on 2 cores.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from rq import Queue
from rq.job import Job

from jobs import keys
from pipeline.client import Client
from pipeline.collector import collect
from jobs.redis_conn import SERIALIZER
from jobs.streams import final_text, read_all
from tests.conftest_redis import (  # noqa: F401
    assert_no_pickle,
    client,
    redis_conn,
    redis_server,
    redis_url,
    spawn_worker,
    wait_for_workers,
)
from tests.model_available import needs_model

M = "smollm2-135m"
ROOT = Path(__file__).resolve().parent.parent


pytestmark = needs_model(M)

QUESTIONS = [
    "Name a colour.", "Say hello.", "What is 2+2?", "Name a fruit.", "Name an animal.", "Say goodbye.",
    "Name a planet.", "Name a country.", "What day comes after Monday?", "Name a tree.", "Name a river.",
    "Say thank you.", "Name a metal.", "Name a sport.", "Name an ocean.", "Name a vegetable.",
    "Name a musical instrument.", "Name a month.", "Name a bird.", "Name a city.",
]


def chat_jobs(n: int = 20, max_tokens: int = 8, over_budget: int | None = None) -> list[dict]:
    out = []
    for i in range(n):
        mt = max_tokens if i != over_budget else 1_000_000  # prompt + max_tokens over the KV budget
        out.append({"model": M, "custom_id": f"q{i:02d}", "params": {"max_tokens": mt},
                    "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]})
    return out


LONG_PROMPT = "Count from 1 to 1000: 1, 2, 3, 4, 5,"  # the model keeps counting until max_tokens


def wait_generating(client: Client, jid: str, timeout: float = 120.0) -> None:
    """Block until the job's token stream holds a text chunk (it is mid-generation)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e.type == "text" for e in read_all(client.connection, keys.token_stream_key(jid))):
            return
        time.sleep(0.01)
    raise TimeoutError(f"job {jid} did not start generating")


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def test_batch_of_20_two_workers_streams_failures_reuse_no_pickle(client, spawn_worker, tmp_path):
    w1, w2 = spawn_worker(name="it-w1"), spawn_worker(name="it-w2")
    wait_for_workers(client.connection, [w1.name, w2.name])
    bad = 9
    bid = client.submit_batch(chat_jobs(20, over_budget=bad), timeout=300)
    out = tmp_path / "out.jsonl"
    s = collect(client, bid, out, progress=False, timeout=600)
    got = lines(out)
    assert len(got) == 20 and s.written == 20
    assert sorted(x["custom_id"] for x in got) == [f"q{i:02d}" for i in range(20)]
    by = {x["custom_id"]: x for x in got}

    # the over-budget job is a failed line with the engine's reason; the others are done
    failed = by[f"q{bad:02d}"]
    assert failed["response"] is None and failed["error"]["code"] == "invalid_request"
    assert "1000000" in failed["error"]["message"]
    for cid, x in by.items():
        if cid == f"q{bad:02d}":
            continue
        assert x["error"] is None, x
        body = x["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["finish_reason"] in ("stop", "length")

    # every job's streamed chunks concatenate to its final text
    results = dict(client.results(bid))
    workers = set()
    for cid, r in results.items():
        entries = read_all(client.connection, keys.token_stream_key(r.job_id))
        assert entries[0].type == "start" and entries[-1].type == "end", cid
        assert final_text(entries) == r.text, cid
        if r.status == "done":
            assert by[cid]["response"]["body"]["choices"][0]["message"]["content"] == r.text
            workers.add(r.worker)
    assert workers == {w1.name, w2.name}  # both workers took jobs

    # the worker that hit the bad job went on to the next one
    bad_r = results[f"q{bad:02d}"]
    later = [r for r in results.values() if r.worker == bad_r.worker and r.started_at and r.started_at > bad_r.ended_at]
    assert later, "the worker stopped after the failed job"
    rq_bad = Job.fetch(bad_r.job_id, connection=client.connection, serializer=SERIALIZER)
    assert rq_bad.get_status() == "failed"

    st = client.batch_status(bid)
    assert (st.done, st.failed, st.total) == (19, 1, 20)

    # the same batch again: finished results are reused, nothing is generated again
    stream_before = {r.job_id: [e.id for e in read_all(client.connection, keys.token_stream_key(r.job_id))]
                     for r in results.values() if r.status == "done"}
    bid2 = client.submit_batch(chat_jobs(20, over_budget=bad), timeout=300)
    rep = client.last_report
    assert (rep.cached, rep.enqueued) == (19, 1)  # only the failed one is tried again
    out2 = tmp_path / "out2.jsonl"
    collect(client, bid2, out2, progress=False, timeout=300)
    got2 = {x["custom_id"]: x for x in lines(out2)}
    assert len(got2) == 20
    for cid, x in by.items():
        if x["error"] is None:
            assert got2[cid]["response"]["body"]["choices"][0]["message"] == \
                x["response"]["body"]["choices"][0]["message"]
    for jid, ids in stream_before.items():
        assert [e.id for e in read_all(client.connection, keys.token_stream_key(jid))] == ids  # not rerun
    st2 = client.batch_status(bid2)
    assert (st2.cached, st2.done, st2.failed) == (19, 19, 1)

    # `rqllm watch` replays a finished job
    from pipeline.cli import main

    some = results["q00"]
    res = CliRunner().invoke(main, ["watch", some.job_id, "--redis-url", _url(client)])
    assert res.exit_code == 0, res.output
    assert res.stdout.rstrip("\n") == some.text

    # `rqllm status` shows queues, workers and the batches
    res = CliRunner().invoke(main, ["status", "--redis-url", _url(client), "--json"])
    assert res.exit_code == 0, res.output
    status = json.loads(res.stdout)
    assert {w["name"] for w in status["workers"]} == {w1.name, w2.name}
    assert all(w["model"] == M for w in status["workers"])
    assert {b["batch_id"] for b in status["batches"]} == {bid, bid2}

    # nothing anywhere in Redis is pickled
    counts = assert_no_pickle(client.connection)
    assert counts.get("b64-json", 0) >= 19  # rq's own results (return values) are JSON too


def _url(client: Client) -> str:
    kw = client.connection.connection_pool.connection_kwargs
    if kw.get("path"):  # the embedded server's unix socket (pipeline.embedded.RedisServer)
        return f"unix://:{kw.get('password') or ''}@{kw['path']}?db={kw.get('db', 0)}"
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def test_submit_cli_reports_bad_lines_and_watch_before_start(client, spawn_worker, tmp_path):
    from pipeline.cli import main

    url = _url(client)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": M, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6}}),
        json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": M, "messages": [{"role": "user", "content": "x"}], "temperature": -2}}),
        json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                    "body": {"model": M, "prompt": "The sky is", "max_tokens": 6}}),
    ]) + "\n")
    res = CliRunner().invoke(main, ["submit", str(src), "--redis-url", url])
    assert res.exit_code == 1, res.output  # submitted, one line refused
    assert "line 2 (b)" in res.stderr and "temperature" in res.stderr
    bid = res.stdout.strip().splitlines()[-1]
    st = client.batch_status(bid)
    assert st.total == 2
    jid = dict(client.batch_entries(bid))["c"]

    # watch before any worker exists: it waits, then prints the tokens live
    watch = subprocess.Popen([sys.executable, "-c", "from pipeline.cli import main; main()", "watch", jid,
                              "--redis-url", url, "--timeout", "120"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    time.sleep(1.0)
    assert watch.poll() is None  # still waiting
    w = spawn_worker(name="cli-w1")
    out, err = watch.communicate(timeout=180)
    assert watch.returncode == 0, err
    s = collect(client, bid, tmp_path / "o.jsonl", progress=False, timeout=120)
    assert (s.done, s.failed, s.refused) == (2, 1, 1)  # the refused line is in the results too
    assert out.rstrip("\n") == client.result(jid).text
    assert w.alive()


def test_cold_stop_requeues_and_heartbeat_extends(client, spawn_worker, tmp_path):
    w = spawn_worker(name="cold-w1", extra=["--heartbeat-interval", "1"])
    wait_for_workers(client.connection, [w.name])
    jid = client.submit({"model": M, "prompt": LONG_PROMPT, "params": {"max_tokens": 2000}}, timeout=600)
    q = client.queue(M)
    reg = q.started_job_registry
    wait_generating(client, jid)
    assert jid in reg.get_job_ids(cleanup=False)
    # heartbeat: the started-registry entry keeps moving forward (SimpleWorker alone never extends it)
    s1 = client.connection.zscore(reg.key, reg.connection.zrange(reg.key, 0, -1)[0])
    time.sleep(2.5)
    s2 = client.connection.zscore(reg.key, reg.connection.zrange(reg.key, 0, -1)[0])
    assert s2 > s1
    assert s1 - time.time() < 120  # short TTL (interval + 60 s), not timeout + 60 s

    w.signal(signal.SIGTERM)
    time.sleep(1.3)
    w.signal(signal.SIGTERM)
    w.proc.wait(60)
    assert w.proc.returncode == 0
    assert client.job_status(jid) == "queued"
    assert q.get_job_ids()[0] == jid  # back at the front
    assert reg.get_job_ids(cleanup=False) == [] and client.connection.llen(q.intermediate_queue_key) == 0
    entries = read_all(client.connection, keys.token_stream_key(jid))
    assert entries[-1].type == "interrupted"
    assert client.result(jid) is None

    # shorten the job's work so the rerun is quick: cancel it and run a short one through the same worker
    Job.fetch(jid, connection=client.connection, serializer=SERIALIZER).cancel()
    short = client.submit({"model": M, "prompt": "Say hi.", "params": {"max_tokens": 4}})
    w2 = spawn_worker(name="cold-w2", burst=True)
    w2.proc.wait(120)
    assert client.result(short).status == "done"


def test_refuses_functions_outside_the_allowlist(client, spawn_worker, tmp_path):
    marker = tmp_path / "pwned"
    q = Queue(f"rqllm:{M}:high", connection=client.connection, serializer=SERIALIZER)
    evil = q.enqueue("os.system", f"touch {marker}")
    chained = q.enqueue("jobs.tasks.os.system", f"touch {marker}")
    ok = client.submit({"model": M, "prompt": "Say hi.", "params": {"max_tokens": 4}})
    w = spawn_worker(name="allow-w1", burst=True)
    w.proc.wait(120)
    assert not marker.exists()
    for j in (evil, chained):
        j.refresh()
        assert j.get_status() == "failed"
        assert "RefusedJob" in (j.latest_result().exc_string or "")
    assert client.result(ok).status == "done"
    assert_no_pickle(client.connection)


def test_killed_worker_job_is_retried_by_another(client, spawn_worker):
    """SIGKILL mid-job: the heartbeat stops, the entry expires, another worker's maintenance pass finds
    the job abandoned and retries it; the batch completes with the retried result."""
    fast = ["--heartbeat-interval", "1", "--heartbeat-grace", "2", "--maintenance-interval", "1"]
    w1 = spawn_worker(name="kill-w1", extra=fast)
    wait_for_workers(client.connection, [w1.name])
    bid = client.submit_batch([{"model": M, "prompt": LONG_PROMPT, "custom_id": "long",
                                "params": {"max_tokens": 120}}], retries=1)
    jid = client.batch_entries(bid)[0][1]
    wait_generating(client, jid)
    w1.proc.kill()
    w1.proc.wait()
    assert client.result(jid) is None and client.job_status(jid) == "started"
    w2 = spawn_worker(name="kill-w2", extra=fast)
    s = collect(client, bid, Path(w2.log_path).with_suffix(".jsonl"), progress=False, timeout=300)
    assert s.done == 1
    r = client.result(jid)
    assert r.worker == w2.name and r.status == "done"
    assert final_text(read_all(client.connection, keys.token_stream_key(jid))) == r.text


def test_priority_order(client, spawn_worker):
    def one(tag: str, prio: str) -> str:
        bid = client.submit_batch([{"model": M, "prompt": f"Say {tag}.", "params": {"max_tokens": 2}}],
                                  priority=prio)
        return client.batch_entries(bid)[0][1]

    low, default, high = one("low", "low"), one("default", "default"), one("high", "high")
    w = spawn_worker(name="prio-w1", burst=True)
    w.proc.wait(120)
    started = {k: client.result(j).started_at for k, j in (("low", low), ("default", default), ("high", high))}
    assert started["high"] < started["default"] < started["low"]


def test_embedded_submit_wait(tmp_path):
    """No REDIS_URL: `rqllm submit ... -o` runs a private redis-server and a worker, collects, stops all."""
    out = tmp_path / "out.jsonl"
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("Name a fruit.")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", "submit", "Say hi.",
                        str(prompt_file), "--model", M, "--max-tokens", "6", "-o", str(out), "--no-progress"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    bid = p.stdout.strip()
    assert bid.startswith("batch_")
    got = {x["custom_id"]: x for x in lines(out)}
    assert set(got) == {"prompt-1", str(prompt_file)}
    assert all(x["error"] is None for x in got.values())
    assert "embedded cluster" in p.stderr
    # the split it chose, and why: 2 jobs on this machine's CPUs
    assert re.search(r"\d+ worker\(s\) x \d+ engine thread\(s\) \(.*at most 2 job\(s\)", p.stderr), p.stderr


def test_rq_stop_job_command_stops_generation(client, spawn_worker):
    """rq's send_stop_job_command reaches a SimpleWorker-based worker: generation stops between tokens,
    the job is STOPPED and recorded, and the worker goes on with the next job."""
    from rq.command import send_stop_job_command

    w = spawn_worker(name="stop-w1")
    wait_for_workers(client.connection, [w.name])
    bid = client.submit_batch([
        {"model": M, "prompt": LONG_PROMPT, "custom_id": "long", "params": {"max_tokens": 2000}},
        {"model": M, "prompt": "Say hi.", "custom_id": "next", "params": {"max_tokens": 4}},
    ])
    ids = dict(client.batch_entries(bid))
    wait_generating(client, ids["long"])
    send_stop_job_command(client.connection, ids["long"], serializer=SERIALIZER)
    s = collect(client, bid, Path(w.log_path).with_suffix(".jsonl"), progress=False, timeout=300)
    assert (s.done, s.failed) == (1, 1)
    r = client.result(ids["long"])
    assert r.status == "failed" and r.error.code == "stopped"
    assert client.job_status(ids["long"]) == "stopped"
    assert client.result(ids["next"]).worker == w.name
    assert w.alive()

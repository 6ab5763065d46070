"""Collector: OpenAI Batch lines as jobs end, resume without duplicates, torn last line, reconcile."""
from __future__ import annotations

import json
import threading
import time

import pytest
from rq.job import Job

from jobs.ledger import Ledger
from jobs.schemas import JobResult
from pipeline.collector import collect, read_written
from tests.conftest_redis import client, redis_conn, redis_server, redis_url  # noqa: F401

M = "smollm2-135m"


def submit(c, n, dup=0):
    js = [{"model": M, "messages": [{"role": "user", "content": f"Q{i}"}], "custom_id": f"c{i}",
           "params": {"max_tokens": 8}} for i in range(n)]
    js += [{**js[i], "custom_id": f"dup{i}"} for i in range(dup)]
    bid = c.submit_batch(js)
    ids = []
    for _, j in c.batch_entries(bid):
        if j not in ids:
            ids.append(j)
    return bid, ids


def end(c, jid, ok=True):
    r = (JobResult(job_id=jid, status="done", model=M, endpoint="/v1/chat/completions", text=f"answer {jid[:6]}",
                   finish_reason="stop", prompt_tokens=4, completion_tokens=2)
         if ok else JobResult.failed(jid, "invalid_request", "prompt 5 + max_tokens 9 exceeds KV capacity 10"))
    Ledger(c.connection).finish(r, result_ttl=600, stream_ttl=600)


def lines(path):
    return [json.loads(x) for x in open(path, encoding="utf-8")]


def test_collects_as_jobs_end_and_resumes(client, tmp_path):
    bid, ids = submit(client, 6, dup=2)
    out = tmp_path / "out.jsonl"
    end(client, ids[0])
    end(client, ids[1], ok=False)
    with pytest.raises(TimeoutError):
        collect(client, bid, out, progress=False, timeout=1.5, block_ms=200)
    got = lines(out)
    assert sorted(x["custom_id"] for x in got) == ["c0", "c1", "dup0", "dup1"]
    by = {x["custom_id"]: x for x in got}
    assert by["c0"]["response"]["body"]["choices"][0]["message"]["content"].startswith("answer")
    assert by["dup0"]["response"]["body"] == by["c0"]["response"]["body"]
    assert by["c1"]["response"] is None and by["c1"]["error"]["code"] == "invalid_request"
    assert "KV capacity" in by["c1"]["error"]["message"]

    # crash mid-write: a torn last line is cut off and rewritten
    with open(out, "a", encoding="utf-8") as f:
        f.write('{"id": "batch_req_x", "custom_id": "c2", "respo')
    end(client, ids[2])

    def finish_rest():
        time.sleep(0.5)
        for j in ids[3:]:
            end(client, j)

    t = threading.Thread(target=finish_rest)
    t.start()
    s = collect(client, bid, out, progress=False, timeout=30, block_ms=200)
    t.join()
    assert s.already == 4 and s.written == 4 and s.complete
    got = lines(out)
    cids = [x["custom_id"] for x in got]
    assert sorted(cids) == sorted([f"c{i}" for i in range(6)] + ["dup0", "dup1"])
    assert len(cids) == len(set(cids))

    # Collecting a finished batch again writes nothing new.
    s = collect(client, bid, out, progress=False, timeout=5)
    assert s.written == 0 and s.already == 8
    assert len(lines(out)) == 8


def test_resume_without_events_stream(client, tmp_path):
    """Results are the source of truth: with the events stream gone, ended jobs are still written."""
    bid, ids = submit(client, 3)
    for j in ids:
        end(client, j)
    client.connection.delete(f"rqllm:batch:{bid}:events")
    s = collect(client, bid, tmp_path / "o.jsonl", progress=False, timeout=5)
    assert s.written == 3


def test_reconcile_ends_a_batch_whose_job_vanished(client, tmp_path):
    bid, ids = submit(client, 2)
    end(client, ids[0])
    client.connection.delete(Job.key_for(ids[1]))
    s = collect(client, bid, tmp_path / "o.jsonl", progress=False, timeout=20, reconcile_after=0.5, block_ms=200)
    assert (s.done, s.failed) == (1, 1)
    failed = [x for x in lines(tmp_path / "o.jsonl") if x["error"]]
    assert failed[0]["error"]["code"] == "lost"


def test_read_written_truncates_garbage(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c"')
    assert read_written(p) == {"a", "b"}
    assert p.read_bytes() == b'{"custom_id": "a"}\n{"custom_id": "b"}\n'


def test_collector_process_killed_and_restarted_writes_each_line_once(client, redis_url, tmp_path):
    """`rqllm collect` SIGKILLed while jobs keep ending, then started again: every custom_id once. The
    first 20 jobs end before the kill and the rest after it: paced by the clock alone, a collector slow
    to start (a busy machine) found all 60 ended and wrote them all before it was killed."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    n = 60
    bid, ids = submit(client, n)
    out = tmp_path / "out.jsonl"
    stop, killed = threading.Event(), threading.Event()

    def finish_slowly():
        for i, j in enumerate(ids):
            if i == 20:
                killed.wait(60)
            if stop.is_set():
                return
            end(client, j)
            time.sleep(0.03)

    def start_collector():
        return subprocess.Popen([sys.executable, "-c", "from pipeline.cli import main; main()", "collect", bid,
                                 "-o", str(out), "--redis-url", redis_url, "--no-progress", "--timeout", "60"],
                                cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    t = threading.Thread(target=finish_slowly)
    t.start()
    try:
        first = start_collector()
        deadline = time.monotonic() + 30
        while not out.exists() or len(out.read_bytes().splitlines()) < 10:
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        first.wait()
        killed.set()
        written_before = out.read_bytes().count(b"\n")  # whole lines; a torn last one is cut on resume
        assert 10 <= written_before <= 20
        second = start_collector()
        _, err = second.communicate(timeout=90)
        assert second.returncode == 0, err
    finally:
        stop.set()
        killed.set()
        t.join()
    got = [x["custom_id"] for x in lines(out)]
    assert sorted(got) == sorted(f"c{i}" for i in range(n))  # none missing, none twice
    assert f"{written_before} already written" in err.decode()

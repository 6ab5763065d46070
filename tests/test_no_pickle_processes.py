"""No pickle anywhere: a pickled `meta` and a pickled job payload written into Redis
are never unpickled by any process rqllm starts, and nothing rqllm ships would (the compose file has no
rq-dashboard: tests/test_compose.py::test_no_rq_dashboard_nothing_that_unpickles).

Every process that reads job hashes runs against one Redis holding the planted pickles: `rqllm serve`
(the API's batch runner, its batch listing and retrieval, file contents), a worker, `rqllm collect` and
`rqllm status`. Unpickling either pickle would create a marker file; it never appears, the job with the
pickled payload is refused and reported in the batch's error file, the one with the pickled meta runs.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from redis import Redis

from pipeline.client import Client
from tests.api_server import ROOT, ServeProcess
from tests.conftest_redis import redis_server, redis_url, spawn_worker  # noqa: F401
from tests.model_available import needs_model

openai = pytest.importorskip("openai", reason="the openai client is in the test extras: pip install -e '.[test]'")

M = "smollm2-135m"
KEY = "pickle-key-0123456789abcdef"

pytestmark = needs_model(M)


class _Touch:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _cli(redis_url_: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "REDIS_URL": redis_url_, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_pickled_meta_and_payload_in_redis_are_never_unpickled(redis_url, spawn_worker, tmp_path):  # noqa: F811
    marker = tmp_path / "unpickled"
    # the planted pickles are live: unpickling one does run its command (else this test proves nothing)
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Touch(probe)))
    assert probe.exists()

    conn = Redis.from_url(redis_url)
    server = ServeProcess(tmp_path / "data", redis_url=redis_url, keys=[KEY]).start()  # no local worker
    try:
        server.wait_ready(KEY)
        c = server.openai(KEY)
        lines = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": M, "messages": [{"role": "user", "content": q}], "max_tokens": 3}}
                 for cid, q in (("meta", "Say hi."), ("payload", "Say bye."))]
        src = c.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                             purpose="batch")
        batch = c.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions", completion_window="24h")

        client = Client(redis_url)
        deadline = time.monotonic() + 60
        while len(client.batch_entries(batch.id)) < 2 or not all(
                conn.exists(f"rq:job:{jid}") for _, jid in client.batch_entries(batch.id)):
            assert time.monotonic() < deadline, "the batch's jobs were not enqueued"
            time.sleep(0.1)
        jobs = dict(client.batch_entries(batch.id))
        # as anyone with Redis access could: a pickled meta on one job, a pickled payload and meta on the other
        conn.hset(f"rq:job:{jobs['meta']}", "meta", pickle.dumps(_Touch(marker)))
        conn.hset(f"rq:job:{jobs['payload']}", mapping={
            "meta": pickle.dumps(_Touch(marker)),
            "data": zlib.compress(pickle.dumps(("jobs.tasks.generate", None, [_Touch(marker)], {})))})

        status = _cli(redis_url, "status", "--json")  # reads queues, workers, batches while the jobs are queued
        assert status.returncode == 0, status.stderr
        assert batch.id in status.stdout

        w = spawn_worker(M, name="pickle-w1", burst=True)
        w.proc.wait(240)
        assert w.proc.returncode == 0, w.tail()
        assert "refusing job" in Path(w.log_path).read_text()

        deadline = time.monotonic() + 120
        while (b := c.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, b
            time.sleep(0.5)
        assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (1, 1), b
        listed = [x.id for x in c.batches.list()]
        assert batch.id in listed
        errors = [json.loads(x) for x in c.files.content(b.error_file_id).content.decode().splitlines()]
        assert [e["custom_id"] for e in errors] == ["payload"]
        assert "job payload cannot be decoded" in json.dumps(errors[0])
        output = [json.loads(x) for x in c.files.content(b.output_file_id).content.decode().splitlines()]
        assert [o["custom_id"] for o in output] == ["meta"]

        collected = tmp_path / "collected.jsonl"
        col = _cli(redis_url, "collect", batch.id, "-o", str(collected), "--no-progress", "--timeout", "60")
        assert col.returncode == 0, col.stderr
        assert {json.loads(x)["custom_id"] for x in collected.read_text().splitlines()} == {"meta", "payload"}
        status = _cli(redis_url, "status")
        assert status.returncode == 0, status.stderr
    finally:
        server.stop()
    assert not marker.exists(), "a process rqllm started unpickled data from Redis"
    assert "Traceback" not in server.log()

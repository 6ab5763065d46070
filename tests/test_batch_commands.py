"""The commands a batch user reaches for: `rqllm cancel`, `rqllm jobs`, submit's refused lines
kept with the batch as error lines (and a non-zero exit with their count), and `status` / `collect`
counting lines as the API does (refused lines included).

Real Redis, real `rqllm` processes, a real SmolLM2 worker where jobs must run; lines naming a known model
that no worker holds stay queued, for the states before a job ends.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fastapi.testclient import TestClient
from rq.job import Job

from jobs.redis_conn import SERIALIZER
from pipeline.api.app import create_app
from pipeline.api.config import ServeConfig
from pipeline.client import Client
from tests.conftest_redis import client, redis_server, redis_url, spawn_worker, wait_for_workers  # noqa: F401
from tests.model_available import needs_model

ROOT = Path(__file__).resolve().parent.parent
M = "smollm2-135m"
NOBODY = "qwen2.5-coder-1.5b-instruct"  # known to the registry, held by no worker here: its jobs stay queued
KEY = "batch-commands-key-1"


def rqllm(*args: str, redis_url: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "PYTHONPATH": str(ROOT), "REDIS_URL": redis_url}
    return subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def line(cid: str, content: str, model: str = M, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3,
                                **body}})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def batch_json(redis_url: str, batch_id: str) -> dict:  # noqa: F811
    p = rqllm("status", "--json", redis_url=redis_url)
    assert p.returncode == 0, p.stderr
    return next(b for b in json.loads(p.stdout)["batches"] if b["batch_id"] == batch_id)


# --------------------------------------------------------------------------- refused lines, counts, jobs

@needs_model(M)
def test_refused_lines_are_error_lines_of_the_batch_and_every_count_agrees(redis_url, spawn_worker, tmp_path):  # noqa: F811
    w = spawn_worker(M, name="cmd-w1")
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        line("a", "Say hi."),
        line("bad-tokens", "Say hi.", max_tokens=0),
        "{not json",
        line("b", "Say hi."),  # the same content as "a": one job for two lines
        line("c", "Name a colour."),
        line("nobody", "Say hi.", model="no-such-model"),
    ]) + "\n")
    sub = rqllm("submit", str(path), redis_url=redis_url)
    assert sub.returncode == 1, sub.stderr  # submitted, but three lines were refused
    batch_id = sub.stdout.strip()
    assert f"{batch_id}: 3 line(s) refused" in sub.stderr, sub.stderr
    assert f"refused: {path}: line 2 (bad-tokens): max_tokens: Input should be greater than or equal to 1 (got 0)" \
        in sub.stderr.splitlines()

    wait_for_workers(Client(redis_url).connection, [w.name])
    out = tmp_path / "out.jsonl"
    col = rqllm("collect", batch_id, "-o", str(out), "--no-progress", "--timeout", "120", redis_url=redis_url)
    assert col.returncode == 0, col.stderr
    assert "3 of the 6 line(s) were refused at submission" in col.stderr, col.stderr
    lines = read_jsonl(out)
    assert sorted(str(x["custom_id"]) for x in lines) == ["None", "a", "b", "bad-tokens", "c", "nobody"]
    refused = {x["custom_id"]: x["error"] for x in lines if x["response"] is None}
    assert set(refused) == {"bad-tokens", None, "nobody"}
    assert refused["bad-tokens"] == {"code": "invalid_request", "param": "max_tokens", "line": 2, "file": str(path),
                                     "message": "max_tokens: Input should be greater than or equal to 1 (got 0)"}
    assert refused[None]["line"] == 3 and refused[None]["message"].startswith("invalid JSON")
    assert refused["nobody"]["code"] == "model_not_found" and refused["nobody"]["line"] == 6
    assert all(x["response"]["status_code"] == 200 for x in lines if x["custom_id"] in ("a", "b", "c"))

    again = rqllm("collect", batch_id, "-o", str(out), "--no-progress", "--timeout", "60", redis_url=redis_url)
    assert again.returncode == 0 and "0 new line(s), 6 already written" in again.stderr, again.stderr
    assert len(read_jsonl(out)) == 6  # resumed: nothing written twice

    b = batch_json(redis_url, batch_id)  # lines, as the API counts them
    assert (b["requests"], b["done"], b["failed"], b["refused"], b["pending"], b["jobs"]) == (6, 3, 3, 3, 0, 2)
    text = rqllm("status", redis_url=redis_url).stdout
    assert f"{batch_id}" in text and "3/6 done, 3 failed (3 refused), 0 pending (2 jobs" in text, text

    jobs = rqllm("jobs", batch_id, redis_url=redis_url)
    assert jobs.returncode == 0, jobs.stderr
    rows = [r.split() for r in jobs.stdout.splitlines()]
    assert [(r[1], r[2]) for r in rows] == [("done", "a"), ("done", "b"), ("done", "c"), ("refused", "bad-tokens"),
                                           ("refused", "-"), ("refused", "nobody")]
    assert rows[0][0] == rows[1][0] != rows[2][0] and rows[3][0] == "-"
    assert f"{batch_id}: 6 line(s): 3 done, 3 refused" in jobs.stderr
    watch = rqllm("watch", rows[2][0], "--timeout", "30", redis_url=redis_url)
    assert watch.returncode == 0 and "[done:" in watch.stderr, watch.stderr


def test_jobs_lists_queued_jobs_so_watch_can_be_used_before_they_end(client: Client, redis_url):  # noqa: F811
    batch_id = client.submit_batch([{"model": NOBODY, "prompt": f"Count to {n}.", "custom_id": f"q{n}",
                                     "params": {"max_tokens": 2}} for n in (1, 2)])
    p = rqllm("jobs", batch_id, "--json", redis_url=redis_url)
    assert p.returncode == 0, p.stderr
    got = [json.loads(x) for x in p.stdout.splitlines()]
    assert [(g["custom_id"], g["state"]) for g in got] == [("q1", "queued"), ("q2", "queued")]
    assert {g["job_id"] for g in got} == {jid for _, jid in client.batch_entries(batch_id)}
    unknown = rqllm("jobs", "batch_nope", redis_url=redis_url)
    assert unknown.returncode == 1 and unknown.stderr.strip() == "Error: no such batch: batch_nope"


# --------------------------------------------------------------------------- the API's counts

def test_status_counts_an_api_batch_as_the_api_does(redis_url: str, tmp_path: Path):  # noqa: F811
    """An API batch with one invalid line of three: the API says total 3, failed 1; so does `rqllm status`
    (before: 2/2), and `rqllm collect` writes the refused line too."""
    auth = {"Authorization": f"Bearer {KEY}"}
    text = "\n".join([line("x", "Hi", model=NOBODY), line("y", "Hello", model=NOBODY),
                      line("z", "Hey", model=NOBODY, top_p=7)]) + "\n"
    with TestClient(create_app(ServeConfig(redis_url=redis_url, data_dir=tmp_path / "data", api_keys=[KEY]))) as tc:
        f = tc.post("/v1/files", headers=auth, files={"file": ("in.jsonl", text.encode())}, data={"purpose": "batch"})
        b = tc.post("/v1/batches", headers=auth, json={"input_file_id": f.json()["id"],
                                                       "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        batch_id = b.json()["id"]
        deadline = time.monotonic() + 20
        while (api := tc.get(f"/v1/batches/{batch_id}", headers=auth).json())["status"] != "in_progress":
            assert time.monotonic() < deadline, api
            time.sleep(0.05)
        ours = batch_json(redis_url, batch_id)
        assert (ours["requests"], ours["failed"], ours["done"]) == (api["request_counts"]["total"],
                                                                 api["request_counts"]["failed"],
                                                                 api["request_counts"]["completed"]) == (3, 1, 0)
        out = tmp_path / "collected.jsonl"
        rqllm("collect", batch_id, "-o", str(out), "--no-progress", "--timeout", "3", redis_url=redis_url)
        refused = [x for x in read_jsonl(out) if x["response"] is None]
        assert [(x["custom_id"], x["error"]["param"], x["error"]["line"]) for x in refused] == [("z", "top_p", 3)]
        # the API's own files are its runner's: it writes the refused line once, in its error file
        cancel = rqllm("cancel", batch_id, redis_url=redis_url)
        assert cancel.returncode == 1 and "created through the API: cancel it there" in cancel.stderr


# --------------------------------------------------------------------------- cancel

def test_cancel_takes_queued_jobs_off_their_queue_and_collect_writes_their_lines(client: Client, redis_url,  # noqa: F811
                                                                                 tmp_path: Path):
    batch_id = client.submit_batch([{"model": NOBODY, "prompt": f"Count to {n}.", "custom_id": f"q{n}",
                                     "params": {"max_tokens": 2}} for n in range(3)])
    shared = client.submit_batch([{"model": NOBODY, "prompt": "Count to 0.", "custom_id": "other",
                                   "params": {"max_tokens": 2}}])  # another batch waits for q0's job
    assert client.queue(NOBODY).count == 3
    p = rqllm("cancel", batch_id, redis_url=redis_url)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == (f"{batch_id}: 2 job(s) cancelled before they ran, 1 job(s) left to another batch "
                                "waiting for them")
    assert client.queue(NOBODY).count == 1  # the shared job stays for the other batch
    out = tmp_path / "out.jsonl"
    col = rqllm("collect", batch_id, "-o", str(out), "--no-progress", "--timeout", "5", redis_url=redis_url)
    lines = {x["custom_id"]: x for x in read_jsonl(out)}
    assert {c: x["error"]["code"] for c, x in lines.items() if x["error"]} == {"q1": "batch_cancelled",
                                                                               "q2": "batch_cancelled"}
    assert "q0" not in lines and col.returncode == 1  # still pending for the other batch: collect timed out
    assert client.batch_status(shared).pending == 1
    assert batch_json(redis_url, batch_id)["cancelled"] is True
    assert rqllm("cancel", "batch_nope", redis_url=redis_url).stderr.strip() == "Error: no such batch: batch_nope"


@needs_model(M)
def test_cancel_stops_a_running_job_and_the_worker_goes_on(client: Client, redis_url, spawn_worker):  # noqa: F811
    w = spawn_worker(M, name="cmd-cancel-w1")
    wait_for_workers(client.connection, [w.name])
    # a raw count goes on and on (a chat answer may end within the second it takes to cancel)
    batch_id = client.submit_batch([{"model": M, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "custom_id": "long",
                                     "params": {"max_tokens": 3000}}])
    (_, jid), = client.batch_entries(batch_id)
    deadline = time.monotonic() + 60
    while Job.fetch(jid, connection=client.connection, serializer=SERIALIZER).get_status() != "started":
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)
    p = rqllm("cancel", batch_id, redis_url=redis_url)
    assert p.returncode == 0 and p.stdout.strip() == f"{batch_id}: 1 job(s) stopping (were running)", \
        (p.stdout, client.result(jid))
    res = client.wait(jid, timeout=30)
    assert res.status == "failed" and res.error.code == "batch_cancelled"
    after = client.submit_batch([{"model": M, "prompt": "Say hi.", "custom_id": "next", "params": {"max_tokens": 2}}])
    (_, nid), = client.batch_entries(after)
    assert client.wait(nid, timeout=60).status == "done"  # the worker took the next job

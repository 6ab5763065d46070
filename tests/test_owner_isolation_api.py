"""Isolation by owner end to end: a real `rqllm serve` with two keys, a real Redis and one
real SmolLM2 worker (so every request runs on the same worker, right after the one before it). No mocks.

Key A's prompt holds a secret; key B sends a guess sharing its first tokens. B's answer must not depend
on whether A's prompt ran just before (no prefix-cache hit, no timing, no worker name in it); identical
requests of the two keys are two jobs; B can neither read A's running job nor touch A's batch. Within one
key the prefix cache still works (the job records that operators read say so).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from jobs import keys
from pipeline.client import Client
from pipeline.embedded import WorkerProcess, stop_workers, worker_argv
from tests.api_server import ServeProcess
from tests.conftest_redis import wait_for_workers
from tests.model_available import needs_model
from tests.redis_server import redis_server  # noqa: F401  (session fixture)

openai = pytest.importorskip("openai", reason="the openai client is in the test extras: pip install -e '.[test]'")

M = "smollm2-135m"
KEY_A, KEY_B = "isolation-a-" + "1" * 16, "isolation-b-" + "2" * 16
SECRET = "The account PIN is 7391. The account PIN is 7391, and nobody else may know it."
GUESS = "The account PIN is 7 zz"
LONG_PROMPT = "Count from 1 to 1000: 1, 2, 3, 4, 5,"  # the model keeps counting until max_tokens
WORKER = "isolation-w1"

pytestmark = needs_model(M)


class Stack:
    def __init__(self, server: ServeProcess, redis_url: str):
        self.server = server
        self.redis = Redis.from_url(redis_url)
        self.client = Client(redis_url)

    def post(self, key: str, path: str, body: dict) -> dict:
        r = httpx.post(self.server.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    def record(self, job_id: str) -> dict:
        """The job's record in Redis (what operators read through the CLI)."""
        raw = self.redis.get(keys.result_key(job_id))
        assert raw is not None, f"no result for {job_id}"
        return json.loads(raw)

    def forget(self, job_id: str) -> None:
        """Drop a stored result, so the next identical request of its key is generated again."""
        assert self.redis.delete(keys.result_key(job_id)) == 1


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory) -> Iterator[Stack]:  # noqa: F811
    Redis.from_url(redis_server).flushdb()
    base = tmp_path_factory.mktemp("isolation")
    worker = WorkerProcess(worker_argv(redis_server, M, threads=1, name=WORKER), str(base / f"{WORKER}.log"))
    server = ServeProcess(base / "data", redis_url=redis_server, keys=[KEY_A, KEY_B]).start()
    try:
        wait_for_workers(Redis.from_url(redis_server), [WORKER])
        server.wait_ready(KEY_A, models=True)
        yield Stack(server, redis_server)
    finally:
        server.stop()
        stop_workers([worker])


def without_created(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "created"}  # the clock, not another key's work


def test_second_keys_answer_is_the_same_whether_or_not_the_first_keys_prompt_ran_just_before(stack: Stack):
    guess = {"model": M, "prompt": GUESS, "max_tokens": 8}
    alone = stack.post(KEY_B, "/completions", guess)
    job_b = alone["id"].removeprefix("cmpl-")
    first = stack.record(job_b)
    stack.forget(job_b)

    secret = stack.post(KEY_A, "/completions", {"model": M, "prompt": SECRET, "max_tokens": 8})
    after = stack.post(KEY_B, "/completions", guess)
    again, of_a = stack.record(job_b), stack.record(secret["id"].removeprefix("cmpl-"))
    # B's guess was generated again, on the same worker, right after A's secret
    assert again["started_at"] >= of_a["ended_at"] and again["ended_at"] > first["ended_at"]
    assert again["worker"] == of_a["worker"] == WORKER

    assert without_created(after) == without_created(alone)  # content, usage, ids and every other field
    assert set(after) == {"id", "object", "created", "model", "choices", "usage", "rqllm"}
    assert after["rqllm"] == {"job_id": job_b}
    assert WORKER not in json.dumps(after)
    # and the worker did not reuse A's tokens for B (its prefill time would have told B)
    assert again["prefix_hit_tokens"] == 0


def test_a_keys_repeated_prompt_still_reuses_its_own_prefix(stack: Stack):
    req = {"model": M, "prompt": SECRET + " Write it down twice.", "max_tokens": 8}  # a job no other test has
    first = stack.post(KEY_A, "/completions", req)
    job = first["id"].removeprefix("cmpl-")
    assert stack.record(job)["prefix_hit_tokens"] == 0  # the worker's previous job was another key's
    stack.forget(job)
    second = stack.post(KEY_A, "/completions", req)  # generated again, right after the first
    record = stack.record(job)
    assert record["prefix_hit_tokens"] == record["prompt_tokens"] - 1  # all but the last token, for its logits
    assert second["id"] == first["id"] and second["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert second["rqllm"] == {"job_id": job}  # the hits are in the record and the logs only


def test_identical_requests_of_two_keys_are_computed_separately(stack: Stack):
    body = {"model": M, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6}
    a = stack.post(KEY_A, "/chat/completions", body)
    b = stack.post(KEY_B, "/chat/completions", body)
    job_a, job_b = a["id"].removeprefix("chatcmpl-"), b["id"].removeprefix("chatcmpl-")
    assert job_a != job_b
    rec_a, rec_b = stack.record(job_a), stack.record(job_b)
    assert rec_b["started_at"] >= rec_a["ended_at"]  # B's ran after A's had its result: not A's result
    assert stack.client.job_status(job_a) == stack.client.job_status(job_b) == "finished"
    assert rec_a["worker"] == rec_b["worker"] == WORKER and b["choices"][0]["message"]["content"]
    assert b["rqllm"] == {"job_id": job_b}


def wait_for(what: str, cond: Any, timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return got


def test_a_key_can_neither_read_nor_cancel_another_keys_running_job(stack: Stack, tmp_path: Path):
    a, b = stack.server.openai(KEY_A), stack.server.openai(KEY_B)
    messages = [{"role": "user", "content": LONG_PROMPT}]
    line = {"custom_id": "long", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": M, "messages": messages, "max_tokens": 120}}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(line) + "\n")
    batch = a.batches.create(input_file_id=a.files.create(file=src.open("rb"), purpose="batch").id,
                             endpoint="/v1/chat/completions", completion_window="24h")
    job_a = wait_for("A's batch was not submitted", lambda: stack.client.batch_entries(batch.id))[0][1]
    wait_for("A's job did not start", lambda: stack.client.job_status(job_a) == "started")

    # B asks the very same thing while A's job runs, and leaves: B must get a job of its own
    stream = b.chat.completions.create(model=M, messages=messages, max_tokens=120, stream=True)
    first = next(iter(stream))
    stream.close()
    assert first.id != f"chatcmpl-{job_a}", "B was streamed A's running job"
    job_b = first.id.removeprefix("chatcmpl-")
    for call in (lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()

    done = wait_for("A's batch did not end", lambda: (x := a.batches.retrieve(batch.id)).status in
                    ("completed", "failed", "cancelled", "expired") and x)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (1, 0)
    (out,) = [json.loads(x) for x in a.files.content(done.output_file_id).text.splitlines()]
    assert out["response"]["body"]["rqllm"] == {"job_id": job_a}
    assert stack.record(job_a)["status"] == "done"
    ended_b = wait_for("B's job was not cancelled", lambda: stack.redis.get(keys.result_key(job_b)))
    assert json.loads(ended_b)["error"]["code"] == "cancelled"  # B's leaving cancelled B's job only

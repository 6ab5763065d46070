"""Isolation by owner: one API key learns nothing of another's work.

* the engine reuses a cached prompt prefix only for the owner whose request left it there;
* a job's owner is part of its content id, so jobs, stored results and cancellation are per owner;
* the API: identical requests of two keys are two jobs, a key's stored result is never another's answer,
  a key cannot cancel or join another's batch jobs, and /v1/models names models only.

The engine test runs the real SmolLM2; the API tests run the app in-process (Starlette's TestClient)
on a real Redis, with a registered worker for a model that runs nothing (the test finishes the jobs
through the ledger, as a worker would). tests/test_owner_isolation_api.py does it with real workers.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.params import SamplingParams
from jobs.ledger import Ledger
from jobs.schemas import GenerationJob, InvalidJob, JobResult, queue_names, validate_job
from pipeline.api.app import create_app
from pipeline.api.config import ServeConfig
from pipeline.client import Client
from tests.conftest_redis import client, redis_server, redis_url  # noqa: F401
from tests.model_available import needs_model

M = "smollm2-135m"
NOBODY = "model-run-by-the-test"  # its worker is registered but runs nothing: jobs stay queued
KA, KB = "isolation-key-a", "isolation-key-b"
SECRET = "The account PIN is 7391. The account PIN is 7391, and nobody else may know it."
GUESS = "The account PIN is 7 zz"


# --------------------------------------------------------------------------- engine

@needs_model(M)
def test_engine_reuses_a_prefix_only_for_the_owner_that_left_it():
    from engine.engine import Engine

    eng = Engine(M, threads=1, kv_budget="32MiB")
    p = SamplingParams(max_tokens=6)
    eng.generate(prompt=SECRET, params=p, owner="key-a")
    after_a = eng.generate(prompt=GUESS, params=p, owner="key-b")
    assert after_a.prefix_hit_tokens == 0  # nothing of key-a's prompt is reused for key-b
    eng.forget_cache()
    alone = eng.generate(prompt=GUESS, params=p, owner="key-b")
    assert (after_a.ids, after_a.text, after_a.prompt_tokens, after_a.completion_tokens, after_a.finish_reason) == \
        (alone.ids, alone.text, alone.prompt_tokens, alone.completion_tokens, alone.finish_reason)

    # Within an owner the cache still works, and the owner None (CLI jobs) is an owner of its own.
    eng.generate(prompt=SECRET, params=p, owner="key-a")
    own = eng.generate(prompt=SECRET, params=SamplingParams(max_tokens=7), owner="key-a")
    assert own.prefix_hit_tokens == own.prompt_tokens - 1
    assert eng.generate(prompt=SECRET, params=p, owner=None).prefix_hit_tokens == 0
    assert eng.generate(prompt=SECRET, params=p).prefix_hit_tokens == own.prompt_tokens - 1  # None again


# --------------------------------------------------------------------------- job ids

def test_the_owner_is_part_of_a_jobs_id():
    def job(**kw: Any) -> GenerationJob:
        return GenerationJob(model=M, prompt="Hello", **kw)

    ids = {job().id, job(owner="key-a").id, job(owner="key-b").id, job(owner="local").id}
    assert len(ids) == 4
    assert job(owner="key-a").id == job(owner="key-a", custom_id="other", metadata={"x": 1}).id
    # it travels with the job: the worker checks the id against the content, the owner included
    payload = job(owner="key-a").to_payload()
    assert payload["owner"] == "key-a" and GenerationJob.model_validate(payload).id == job(owner="key-a").id
    with pytest.raises(ValueError, match="does not match"):
        GenerationJob.model_validate({**payload, "owner": "key-b"})
    for bad in ("", "has space", "x" * 129, "tab\there"):
        with pytest.raises(InvalidJob, match="owner"):
            validate_job({"model": M, "prompt": "Hello", "owner": bad})


def test_submit_batch_puts_its_owner_on_every_job(client: Client, holder: Any):  # noqa: F811
    jobs = [{"model": NOBODY, "prompt": "same", "custom_id": "a"}]
    mine, theirs, cli = (client.submit_batch(jobs, owner="key-a"), client.submit_batch(jobs, owner="key-b"),
                         client.submit_batch(jobs))
    (_, a), (_, b), (_, c) = (client.batch_entries(x)[0] for x in (mine, theirs, cli))
    assert len({a, b, c}) == 3  # three jobs: none joins another owner's
    assert client.submit_batch(jobs, owner="key-a") and client.last_report.joined == 1  # the owner's own job
    with pytest.raises(InvalidJob, match="owner"):
        client.submit_batch([{**jobs[0], "owner": "key-b"}], owner="key-a")


# --------------------------------------------------------------------------- the API, in-process

def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def holder(client: Client) -> Iterator[Any]:  # noqa: F811
    """A live worker for NOBODY (so the API accepts the model); it runs nothing."""
    from pipeline.worker import LLMWorker

    w = LLMWorker(queue_names(NOBODY), model=NOBODY, connection=client.connection, name="isolation-holder-w7")
    w.register_birth()
    try:
        yield w
    finally:
        w.register_death()


@pytest.fixture
def tc(redis_url: str, tmp_path: Path, holder: Any) -> Iterator[TestClient]:  # noqa: F811
    config = ServeConfig(redis_url=redis_url, data_dir=tmp_path / "data", api_keys=[KA, KB])
    with TestClient(create_app(config)) as c:
        yield c


def wait_until(what: str, cond: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return got


def finish(client: Client, job_id: str, text: str) -> None:  # noqa: F811
    """What a worker would record for the job."""
    Ledger(client.connection).finish(JobResult(job_id=job_id, status="done", model=NOBODY, text=text,
                                               endpoint="/v1/chat/completions", finish_reason="stop", prompt_tokens=3,
                                               completion_tokens=1, worker="isolation-holder-w7",
                                               prefix_hit_tokens=2, prefill_seconds=0.25),
                                     result_ttl=600, stream_ttl=600)


def ask(tc: TestClient, client: Client, key: str, body: dict) -> tuple[str, dict]:  # noqa: F811
    """POST /v1/chat/completions for `key`; the job it queues is finished with text naming it.
    Returns (job id, response body)."""
    queue = client.queue(NOBODY, "high")
    before = set(queue.job_ids)
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(r=tc.post("/v1/chat/completions", headers=auth(key), json=body)))
    t.start()
    try:
        # Today's code answered the second key at once with the first key's stored result: no job is queued.
        new = wait_until(f"no job was queued for {key}'s request",
                         lambda: (set(queue.job_ids) - before) or ("r" in box and {"answered-without-a-job"}))
        assert new != {"answered-without-a-job"}, f"{key} got an answer without a job of its own: {box['r'].text}"
        (job_id,) = new
        finish(client, job_id, f"text of the job for {key}")
    finally:
        t.join(30)
    r = box["r"]
    assert r.status_code == 200, r.text
    return job_id, r.json()


def test_identical_requests_of_two_keys_are_two_jobs(tc: TestClient, client: Client):  # noqa: F811
    body = {"model": NOBODY, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 3}
    job_a, answer_a = ask(tc, client, KA, body)
    job_b, answer_b = ask(tc, client, KB, body)  # A's result is stored: B must not get it
    assert job_a != job_b
    assert answer_a["choices"][0]["message"]["content"] == f"text of the job for {KA}"
    assert answer_b["choices"][0]["message"]["content"] == f"text of the job for {KB}"
    assert answer_b["id"] == f"chatcmpl-{job_b}"
    # OpenAI's fields and the caller's own job id; not the worker, its timings or cache hits
    for answer, job_id in ((answer_a, job_a), (answer_b, job_b)):
        assert set(answer) == {"id", "object", "created", "model", "choices", "usage", "rqllm"}
        assert answer["rqllm"] == {"job_id": job_id}
        assert "isolation-holder-w7" not in json.dumps(answer)
    # each key's own identical request is served from its own stored result
    r = tc.post("/v1/chat/completions", headers=auth(KB), json=body)
    assert r.json()["id"] == f"chatcmpl-{job_b}" and r.json()["choices"] == answer_b["choices"]


def upload_batch(tc: TestClient, key: str, lines: list[dict]) -> dict:
    text = "".join(json.dumps(x) + "\n" for x in lines)
    r = tc.post("/v1/files", headers=auth(key), files={"file": ("in.jsonl", text.encode())}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    r = tc.post("/v1/batches", headers=auth(key), json={"input_file_id": r.json()["id"],
                                                        "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert r.status_code == 200, r.text
    return r.json()


def batch_status(tc: TestClient, key: str, batch_id: str) -> str:
    return tc.get(f"/v1/batches/{batch_id}", headers=auth(key)).json()["status"]


def test_a_key_cannot_cancel_join_or_read_another_keys_batch_jobs(tc: TestClient, client: Client):  # noqa: F811
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": NOBODY, "messages": [{"role": "user", "content": f"{SECRET} {i}"}]}} for i in range(3)]
    a = upload_batch(tc, KA, lines)
    wait_until("A's batch was not submitted", lambda: batch_status(tc, KA, a["id"]) == "in_progress")
    b = upload_batch(tc, KB, lines)  # the same lines
    wait_until("B's batch was not submitted", lambda: batch_status(tc, KB, b["id"]) == "in_progress")
    jobs_a = {j for _, j in client.batch_entries(a["id"])}
    jobs_b = {j for _, j in client.batch_entries(b["id"])}
    assert len(jobs_a) == len(jobs_b) == 3
    assert not jobs_a & jobs_b, "B's batch joined A's jobs"

    for r in (tc.get(f"/v1/batches/{a['id']}", headers=auth(KB)), tc.post(f"/v1/batches/{a['id']}/cancel",
                                                                           headers=auth(KB))):
        assert r.status_code == 404
    assert tc.post(f"/v1/batches/{b['id']}/cancel", headers=auth(KB)).status_code == 200
    wait_until("B's batch was not cancelled", lambda: batch_status(tc, KB, b["id"]) == "cancelled")
    assert {client.job_status(j) for j in jobs_b} == {"canceled"}
    assert {client.job_status(j) for j in jobs_a} == {"queued"}  # A's work is untouched
    assert batch_status(tc, KA, a["id"]) == "in_progress"
    assert client.results_for(sorted(jobs_a)) == {}


def test_models_name_models_not_workers_hosts_or_jobs(tc: TestClient, holder: Any, client: Client):  # noqa: F811
    listed = tc.get("/v1/models", headers=auth(KB))
    one = tc.get(f"/v1/models/{NOBODY}", headers=auth(KB))
    assert listed.status_code == one.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == [NOBODY]
    for model in (*listed.json()["data"], one.json()):
        assert set(model) == {"id", "object", "created", "owned_by"}
    worker = next(w for w in client.workers() if w["name"] == holder.name)
    for secret in (holder.name, worker["hostname"]):
        assert secret not in listed.text and secret not in one.text

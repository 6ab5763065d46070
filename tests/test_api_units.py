"""The API's own logic against a real Redis, without workers: the app runs in-process (Starlette's
TestClient, which also runs its lifespan and batch runners), jobs stay queued for a model no worker
holds. Covers what needs no generation: keys and loopback, ownership, file listing and limits,
validation failures, cancel and expiry of queued jobs, a restarted app resuming its state, and
pipeline.cancel's rules for shared jobs."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from rq.job import Job

from jobs import keys
from jobs.schemas import JobResult
from pipeline.api.app import create_app
from pipeline.api.auth import KeyRing, owner_id
from pipeline.api.config import ServeConfig
from pipeline.api.errors import APIError
from pipeline.cancel import cancel_unwanted_job
from pipeline.client import Client
from jobs.redis_conn import SERIALIZER
from tests.conftest_redis import client, redis_server, redis_url  # noqa: F401

NOBODY = "qwen2.5-coder-1.5b-instruct"  # a known model no worker holds here: jobs for it stay queued
K1, K2 = "unit-key-1", "unit-key-2"


def line(cid: str, content: str = "Hi", **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": NOBODY, "messages": [{"role": "user", "content": content}], **body}})


def app_client(redis_url: str, data_dir: Path, **config) -> TestClient:  # noqa: F811
    config.setdefault("api_keys", [K1, K2])
    return TestClient(create_app(ServeConfig(redis_url=redis_url, data_dir=data_dir, **config)))


def auth(key: str = K1) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def upload(tc: TestClient, text: str, key: str = K1, purpose: str = "batch") -> dict:
    r = tc.post("/v1/files", headers=auth(key), files={"file": ("in.jsonl", text.encode())}, data={"purpose": purpose})
    assert r.status_code == 200, r.text
    return r.json()


def create_batch(tc: TestClient, file_id: str, key: str = K1) -> dict:
    r = tc.post("/v1/batches", headers=auth(key), json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                        "completion_window": "24h"})
    assert r.status_code == 200, r.text
    return r.json()


def wait_status(tc: TestClient, batch_id: str, statuses: tuple[str, ...], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = tc.get(f"/v1/batches/{batch_id}", headers=auth()).json()
        if b["status"] in statuses:
            return b
        time.sleep(0.05)
    raise TimeoutError(f"batch {batch_id} is {b['status']}, not {statuses}")


def content_lines(tc: TestClient, file_id: str) -> list[dict]:
    r = tc.get(f"/v1/files/{file_id}/content", headers=auth())
    assert r.status_code == 200
    return [json.loads(x) for x in r.text.splitlines()]


@pytest.fixture
def tc(redis_url: str, tmp_path: Path) -> Iterator[TestClient]:  # noqa: F811
    with app_client(redis_url, tmp_path / "data") as c:
        yield c


def test_keyring_owners_and_refusals():
    ring = KeyRing(["alpha", "beta"])
    assert ring.authenticate("Bearer alpha", "10.0.0.1") == owner_id("alpha") != owner_id("beta")
    assert "alpha" not in owner_id("alpha")
    for header in (None, "Bearer ", "Basic alpha", "Bearer gamma"):
        with pytest.raises(APIError) as e:
            ring.authenticate(header, "127.0.0.1")
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    open_ring = KeyRing([])
    assert open_ring.authenticate(None, "127.0.0.1") == open_ring.authenticate(None, "::1") == "local"
    with pytest.raises(APIError) as e:
        open_ring.authenticate(None, "192.168.1.7")
    assert e.value.status_code == 403
    assert KeyRing([], insecure_no_auth=True).authenticate(None, "192.168.1.7") == "local"


def test_serve_refuses_to_listen_publicly_without_a_key(tmp_path: Path):
    from pipeline.cli import main

    r = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path)], env={"REDIS_URL": "",
                                                                                                  "RQLLM_API_KEYS": ""})
    assert r.exit_code != 0 and "no API key configured" in r.output
    assert not (tmp_path / "redis").exists()  # refused before anything started


def test_no_key_means_loopback_only(redis_url: str, tmp_path: Path):  # noqa: F811
    with app_client(redis_url, tmp_path, api_keys=[]) as tc:  # TestClient's peer is "testclient", not loopback
        r = tc.get("/v1/files")
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    with app_client(redis_url, tmp_path, api_keys=[], insecure_no_auth=True) as tc:
        assert tc.get("/v1/files").status_code == 200


def test_files_ownership_listing_and_delete(tc: TestClient):
    ids = [upload(tc, line(f"l{i}") + "\n")["id"] for i in range(3)]
    theirs = upload(tc, line("x") + "\n", key=K2)["id"]
    page = tc.get("/v1/files?limit=2", headers=auth()).json()
    assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = tc.get(f"/v1/files?limit=2&after={page['last_id']}", headers=auth()).json()
    assert [f["id"] for f in rest["data"]] == ids[:1] and rest["has_more"] is False
    assert [f["id"] for f in tc.get("/v1/files?order=asc", headers=auth()).json()["data"]] == ids
    assert tc.get(f"/v1/files/{theirs}", headers=auth()).status_code == 404
    r = tc.delete(f"/v1/files/{ids[0]}", headers=auth())
    assert r.json() == {"id": ids[0], "object": "file", "deleted": True}
    assert tc.get(f"/v1/files/{ids[0]}/content", headers=auth()).status_code == 404
    r = tc.get(f"/v1/files/{ids[0]}", headers=auth())
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert tc.get("/v1/files/../../etc/passwd", headers=auth()).status_code == 404


def test_request_limit_per_file(redis_url: str, tmp_path: Path):  # noqa: F811
    with app_client(redis_url, tmp_path, max_file_requests=3) as tc:
        r = tc.post("/v1/files", headers=auth(), data={"purpose": "batch"},
                    files={"file": ("in.jsonl", ("\n".join(line(f"l{i}") for i in range(4)) + "\n\n").encode())})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_requests"
        assert list((tmp_path / "files").iterdir()) == []  # nothing left behind
        assert upload(tc, "\n".join(line(f"l{i}") for i in range(3)))["bytes"] > 0


def test_batch_with_no_valid_line_fails_with_line_numbers(tc: TestClient):
    f = upload(tc, "not json\n" + line("t", temperature=5000) + "\n")
    b = wait_status(tc, create_batch(tc, f["id"])["id"], ("failed",))
    assert b["failed_at"] and b["output_file_id"] is None and b["error_file_id"] is None
    lines = {e["line"]: e["message"] for e in b["errors"]["data"] if e["line"]}
    assert set(lines) == {1, 2} and "invalid JSON" in lines[1] and "temperature" in lines[2]
    assert b["request_counts"] == {"total": 2, "completed": 0, "failed": 2}


def test_cancel_queued_batch_and_restart_keeps_everything(redis_url: str, tmp_path: Path, client: Client):  # noqa: F811
    data = tmp_path / "data"
    with app_client(redis_url, data) as tc:
        f = upload(tc, "\n".join(line(f"c{i}", f"question {i}") for i in range(4)) + "\n" + line("bad", n=2))
        b = wait_status(tc, create_batch(tc, f["id"])["id"], ("in_progress",))
        assert b["request_counts"] == {"total": 5, "completed": 0, "failed": 1}
        assert client.queue(NOBODY).count == 4 and client.batch_status(b["id"]).requests == 4
    # Another server on the same Redis with its own data dir leaves the batch to the server holding its files.
    with app_client(redis_url, tmp_path / "other") as tc:
        time.sleep(0.5)
        assert not (tmp_path / "other" / "batches" / b["id"]).exists()
        assert tc.get(f"/v1/batches/{b['id']}", headers=auth()).json()["status"] == "in_progress"
    # A new app on the same Redis and data dir: same files and batch, the batch's runner resumed.
    with app_client(redis_url, data) as tc:
        assert tc.get(f"/v1/files/{f['id']}", headers=auth()).json()["bytes"] == f["bytes"]
        assert tc.get(f"/v1/batches/{b['id']}", headers=auth()).json()["status"] == "in_progress"
        assert tc.post(f"/v1/batches/{b['id']}/cancel", headers=auth(K2)).status_code == 404
        assert tc.post(f"/v1/batches/{b['id']}/cancel", headers=auth()).json()["status"] in ("cancelling", "cancelled")
        done = wait_status(tc, b["id"], ("cancelled",))
        assert done["request_counts"] == {"total": 5, "completed": 0, "failed": 5} and done["output_file_id"] is None
        errs = {x["custom_id"]: x["error"]["code"] for x in content_lines(tc, done["error_file_id"])}
        assert errs == {"bad": "invalid_request", **{f"c{i}": "batch_cancelled" for i in range(4)}}
    assert client.queue(NOBODY).count == 0
    assert all(client.job_status(j) == "canceled" for _, j in client.batch_entries(b["id"]))
    assert client.connection.scard(keys.API_ACTIVE_BATCHES) == 0


def test_batch_expires_after_its_window(redis_url: str, tmp_path: Path, client: Client):  # noqa: F811
    with app_client(redis_url, tmp_path, completion_window_seconds=1) as tc:
        b = create_batch(tc, upload(tc, line("e1") + "\n" + line("e2"))["id"])
        assert b["expires_at"] - b["created_at"] <= 1
        done = wait_status(tc, b["id"], ("expired",), timeout=30)
        assert done["expired_at"] and done["request_counts"]["failed"] == 2
        assert {x["error"]["code"] for x in content_lines(tc, done["error_file_id"])} == {"batch_expired"}
    assert client.queue(NOBODY).count == 0


def test_cancel_leaves_jobs_other_batches_wait_for(client: Client):  # noqa: F811
    job = {"model": NOBODY, "prompt": "shared", "custom_id": "a"}
    first = client.submit_batch([job])
    second = client.submit_batch([job])
    (_, jid), = client.batch_entries(first)
    assert cancel_unwanted_job(client.connection, jid, batch_id=first, code="batch_cancelled", message="m") == "shared"
    assert client.job_status(jid) == "queued"
    client.connection.srem(keys.job_batches_key(jid), second)  # the second batch no longer waits
    client.connection.sadd(keys.api_waiters_key(jid), "req-1")  # but an HTTP request does
    assert cancel_unwanted_job(client.connection, jid, batch_id=first, code="batch_cancelled", message="m") == "shared"
    client.connection.delete(keys.api_waiters_key(jid))
    assert cancel_unwanted_job(client.connection, jid, batch_id=first, code="batch_cancelled", message="m") == "cancelled"
    result = client.result(jid)
    assert result.status == "failed" and result.error.code == "batch_cancelled" and result.model == NOBODY
    assert client.job_status(jid) == "canceled" and client.queue(NOBODY).count == 0
    assert client.batch_status(first).failed == 1  # told atomically with the cancel
    assert Job.fetch(jid, connection=client.connection, serializer=SERIALIZER).is_canceled
    assert cancel_unwanted_job(client.connection, jid, batch_id=first, code="x", message="m") == "ended"
    assert isinstance(result, JobResult)


def test_request_whose_job_ended_without_an_outcome_submits_it_again(redis_url: str, tmp_path: Path,  # noqa: F811
                                                                       client: Client):  # noqa: F811
    """An identical request may clear a failed outcome while rq still wraps that run up, and join the run
    instead of starting another: the job then ends with no outcome. The waiting request submits it again."""
    import threading

    from jobs.ledger import Ledger
    from jobs.schemas import queue_names
    from pipeline.worker import LLMWorker

    holder = LLMWorker(queue_names(NOBODY), model=NOBODY, connection=client.connection, name="holder")
    holder.register_birth()  # a live worker for the model (it runs nothing: the test plays its part)
    queue = client.queue(NOBODY, "high")
    try:
        with app_client(redis_url, tmp_path) as tc:
            box: dict = {}
            body = {"model": NOBODY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
            t = threading.Thread(target=lambda: box.update(r=tc.post("/v1/chat/completions", headers=auth(), json=body)))
            t.start()
            deadline = time.monotonic() + 30
            while queue.count == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            job_id = queue.job_ids[0]
            queue.remove(job_id)  # its run ended, its outcome was cleared: not queued, no result
            client.connection.hset(Job.key_for(job_id), "status", "failed")
            while queue.count == 0:
                assert time.monotonic() < deadline, "the waiting request did not submit the job again"
                time.sleep(0.05)
            assert queue.job_ids == [job_id] and client.job_status(job_id) == "queued"
            Ledger(client.connection).finish(JobResult(job_id=job_id, status="done", model=NOBODY, text="again",
                                                       endpoint="/v1/chat/completions", finish_reason="stop",
                                                       prompt_tokens=2, completion_tokens=1),
                                             result_ttl=60, stream_ttl=60)
            t.join(30)
            r = box["r"]
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "again"
            assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    finally:
        holder.register_death()


def test_batches_list_newest_first_in_pages(tc: TestClient):
    source = upload(tc, line("p") + "\n")["id"]
    ids = [create_batch(tc, source)["id"] for _ in range(3)]
    first = tc.get("/v1/batches?limit=2", headers=auth()).json()
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    rest = tc.get(f"/v1/batches?limit=2&after={first['last_id']}", headers=auth()).json()
    assert [b["id"] for b in rest["data"]] == ids[:1] and rest["has_more"] is False
    assert tc.get("/v1/batches", headers=auth(K2)).json()["data"] == []
    r = tc.get("/v1/batches?after=batch_unknown", headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"
    assert tc.get("/v1/batches?limit=101", headers=auth()).status_code == 400

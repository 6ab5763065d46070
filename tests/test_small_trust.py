"""Smaller trust checks, each with its test: API keys normalised once and blank ones
refused at start-up; a duplicate custom_id refused at validation; deeply nested JSON a 400 (and one such
line failing alone); per-key limits on batches and their lines (429; requests in flight:
tests/test_auth_before_body.py); the example .env's placeholder passwords refused at start-up; booleans
refused where numbers are expected; upload filenames reduced to a safe basename.

Real Redis; the API in-process (Starlette's TestClient with its batch runners); `rqllm serve` and
`rqllm worker` as real subprocesses for the start-up refusals.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from jobs import keys
from jobs.redis_conn import PlaceholderPassword, RedisRefused, connect
from jobs.schemas import InvalidJob, validate_job
from pipeline.api.app import create_app
from pipeline.api.auth import KeyRing, owner_id
from pipeline.api.config import ServeConfig, normalize_keys
from pipeline.batch_file import DUPLICATE_CUSTOM_ID, MAX_JSON_DEPTH, parse_lines, request_to_job
from pipeline.embedded import free_port
from tests.conftest_redis import client, redis_server, redis_url  # noqa: F401
from tests.model_available import needs_model

ROOT = Path(__file__).resolve().parent.parent
M = "smollm2-135m"
NOBODY = "qwen2.5-coder-1.5b-instruct"  # a known model no worker holds here: its jobs stay queued
K1, K2 = "small-key-one-123456", "small-key-two-123456"


def line(cid: str, content: str = "Hi", **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": NOBODY, "messages": [{"role": "user", "content": content}], **body}})


def auth(key: str = K1) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def app_client(redis_url: str, data_dir: Path, **config) -> TestClient:  # noqa: F811
    config.setdefault("api_keys", [K1, K2])
    return TestClient(create_app(ServeConfig(redis_url=redis_url, data_dir=data_dir, **config)))


@pytest.fixture
def tc(redis_url: str, tmp_path: Path) -> Iterator[TestClient]:  # noqa: F811
    with app_client(redis_url, tmp_path / "data") as c:
        yield c


def upload(tc: TestClient, text: str, key: str = K1, filename: str = "in.jsonl") -> dict:
    r = tc.post("/v1/files", headers=auth(key), files={"file": (filename, text.encode())}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return r.json()


def create_batch(tc: TestClient, file_id: str, key: str = K1):
    return tc.post("/v1/batches", headers=auth(key), json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                           "completion_window": "24h"})


def wait_status(tc: TestClient, batch_id: str, statuses: tuple[str, ...], key: str = K1, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        b = tc.get(f"/v1/batches/{batch_id}", headers=auth(key)).json()
        if b["status"] in statuses:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} is still {b['status']} after {timeout} s"
        time.sleep(0.05)


def cli(*args: str, env: dict[str, str], timeout: float = 30) -> tuple[int, str]:
    """A real `rqllm` command; its whole process group is killed if it outlives `timeout`."""
    full = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RQLLM_API_KEYS")}
    full.update(PYTHONPATH=str(ROOT), **env)
    p = subprocess.Popen([sys.executable, "-c", "from pipeline.cli import main; main()", *args], cwd=ROOT, env=full,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"`rqllm {' '.join(args)}` was still running after {timeout} s (not refused):\n{out[-2000:]}")
    return p.returncode, out


# --------------------------------------------------------------------------- API keys

def test_keys_are_normalised_once_and_blank_ones_refused():
    assert normalize_keys([" alpha ", "alpha", "beta\n"]) == ["alpha", "beta"]
    for bad in ("", "   ", "\t\n"):
        with pytest.raises(ValueError, match="blank"):
            normalize_keys(["good-key", bad])
    with pytest.raises(ValueError, match="whitespace or control"):
        normalize_keys(["two words"])
    with pytest.raises(ValidationError, match="API key #1 is blank"):
        ServeConfig(redis_url="redis://", api_keys=["   "])
    config = ServeConfig(redis_url="redis://", api_keys=[" alpha "])
    assert config.api_keys == ["alpha"]
    assert KeyRing(config.api_keys).authenticate("Bearer alpha", "10.0.0.1") == owner_id("alpha")
    with pytest.raises(ValueError, match="blank"):
        KeyRing([" "])


def test_serve_refuses_a_blank_api_key_at_start_up(tmp_path: Path):
    """A whitespace-only --api-key passed the exposure check, then counted as no key."""
    for host in ("0.0.0.0", "127.0.0.1"):
        code, out = cli("serve", "--host", host, "--port", str(free_port()), "--data-dir", str(tmp_path),
                        "--api-key", "   ", env={})
        assert code == 1 and "Error: --api-key / RQLLM_API_KEYS: API key #1 is blank" in out, out
        assert "Traceback" not in out
        assert not (tmp_path / "redis").exists()  # refused before anything started


# --------------------------------------------------------------------------- duplicate custom_id

def test_a_duplicate_custom_id_is_refused_at_validation(tc: TestClient, client):  # noqa: F811
    jobs, errors = parse_lines([line("a"), line("b", "other"), line("a", "third")])
    assert [j.custom_id for j in jobs] == ["a", "b"]
    assert [(e.lineno, e.code) for e in errors] == [(3, DUPLICATE_CUSTOM_ID)]
    assert str(errors[0]) == "line 3 (a): duplicate_custom_id: custom_id already used on line 1"

    b = create_batch(tc, upload(tc, "\n".join([line("a"), line("b", "other"), line("a", "third")]))["id"]).json()
    done = wait_status(tc, b["id"], ("failed", "in_progress", "completed"))
    assert done["status"] == "failed", done
    assert done["output_file_id"] is None and done["error_file_id"] is None  # custom_id a is in no file twice
    codes = [(e["code"], e["line"]) for e in done["errors"]["data"]]
    assert (DUPLICATE_CUSTOM_ID, 3) in codes and codes[-1] == (DUPLICATE_CUSTOM_ID, None)
    assert "custom_id values must be unique" in done["errors"]["data"][-1]["message"]
    assert client.connection.keys("rq:queue:*") == [] and not client.connection.exists(keys.batch_key(b["id"]))


# --------------------------------------------------------------------------- deeply nested JSON

DEEP = "[" * 5000 + "]" * 5000  # past what json.loads recurses into
SHALLOW_BUT_DEEP = "[" * (MAX_JSON_DEPTH + 5) + "]" * (MAX_JSON_DEPTH + 5)


def test_a_deeply_nested_line_fails_alone():
    deep = '{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"x": ' + DEEP + '}}'
    lines = [line("a"), deep, '{"custom_id": "d2", "body": ' + SHALLOW_BUT_DEEP + "}", line("b")]
    jobs, errors = parse_lines(lines)
    assert [j.custom_id for j in jobs] == ["a", "b"]
    assert [e.lineno for e in errors] == [2, 3]
    assert all(f"JSON nested more than {MAX_JSON_DEPTH} levels deep" in e.message for e in errors)
    with pytest.raises(InvalidJob, match="nested more than"):
        request_to_job(json.loads('{"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "Hi", "user": '
                                  + SHALLOW_BUT_DEEP + "}}"))


def test_deeply_nested_json_is_a_400_naming_the_problem(tc: TestClient):
    for raw in ('{"model": "%s", "messages": %s}' % (NOBODY, DEEP),
                '{"model": "%s", "messages": %s}' % (NOBODY, SHALLOW_BUT_DEEP)):
        r = tc.post("/v1/chat/completions", headers={**auth(), "Content-Type": "application/json"}, content=raw)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert f"nested more than {MAX_JSON_DEPTH} levels deep" in error["message"]
        assert "RecursionError" not in error["message"] and set(error) == {"message", "type", "param", "code"}
    r = tc.post("/v1/batches", headers={**auth(), "Content-Type": "application/json"}, content=DEEP)
    assert r.status_code == 400, r.text


def test_a_deeply_nested_line_does_not_fail_its_batch(tc: TestClient):
    deep = '{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"x": ' + DEEP + '}}'
    b = create_batch(tc, upload(tc, line("a") + "\n" + deep + "\n")["id"]).json()
    got = wait_status(tc, b["id"], ("in_progress", "failed"))
    assert got["status"] == "in_progress", got
    assert got["request_counts"] == {"total": 2, "completed": 0, "failed": 1}
    assert [e["line"] for e in got["errors"]["data"]] == [2]


# --------------------------------------------------------------------------- per-key limits

def test_per_key_limits_on_batches_and_their_lines(redis_url: str, tmp_path: Path):  # noqa: F811
    with app_client(redis_url, tmp_path, max_active_batches_per_key=2, max_active_lines_per_key=5) as tc:
        def two(n: int) -> str:  # distinct prompts: a batch sharing queued jobs with another cancels slowly
            return upload(tc, line("a", f"first {n}") + "\n" + line("b", f"second {n}"))["id"]

        first = create_batch(tc, two(1)).json()
        assert create_batch(tc, two(2)).status_code == 200
        r = create_batch(tc, two(3))
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert "2 batches not yet ended, the limit is 2" in error["message"]

        four = upload(tc, "\n".join(line(f"l{i}", f"q{i}") for i in range(4)), key=K2)["id"]
        assert create_batch(tc, four, key=K2).status_code == 200  # another key: its own limits
        small = upload(tc, line("x") + "\n" + line("y", "other"), key=K2)["id"]
        r = create_batch(tc, small, key=K2)
        assert r.status_code == 429 and "hold 4 request lines; 2 more would pass the limit of 5" in \
            r.json()["error"]["message"]

        assert tc.post(f"/v1/batches/{first['id']}/cancel", headers=auth()).status_code == 200
        wait_status(tc, first["id"], ("cancelled",))
        assert create_batch(tc, two(4)).status_code == 200  # a batch that ended frees its place


# --------------------------------------------------------------------------- placeholder passwords

def example_placeholders() -> list[str]:
    text = (ROOT / "deploy" / "rqllm.env.example").read_text()
    found = re.findall(r"^\s*#?\s*\w*PASSWORD=(\S+)", text, flags=re.M)
    assert found, text
    return found


def test_the_example_env_passwords_are_refused_before_connecting():
    port = free_port()  # nothing listens there: a connection attempt would retry for ~30 s first
    for pw in example_placeholders():
        for url in (f"redis://:{pw}@127.0.0.1:{port}/0", f"redis://default:{pw}@127.0.0.1:{port}/0",
                    f"redis://127.0.0.1:{port}/0?password={pw}"):
            t0 = time.monotonic()
            with pytest.raises(PlaceholderPassword, match="placeholder password of deploy/rqllm.env.example"):
                connect(url)
            assert time.monotonic() - t0 < 1
            with pytest.raises(ValidationError, match="placeholder"):
                ServeConfig(redis_url=url)
    assert issubclass(PlaceholderPassword, RedisRefused)  # the CLI's one-line error for Redis refusals
    connect(f"redis://:a-real-password@127.0.0.1:{port}/0")  # others pass (no connection is made yet)


def test_serve_refuses_a_placeholder_password_at_start_up(tmp_path: Path):
    pw = example_placeholders()[0]
    code, out = cli("serve", "--port", str(free_port()), "--data-dir", str(tmp_path),
                    env={"REDIS_URL": f"redis://:{pw}@127.0.0.1:{free_port()}/0"})
    assert code == 1 and "Error: --redis-url / REDIS_URL: the Redis URL holds the placeholder password" in out, out
    assert "Traceback" not in out and pw not in out


@needs_model(M)
def test_worker_refuses_a_placeholder_password_at_start_up():
    pw = example_placeholders()[0]
    code, out = cli("worker", "--model", M, "--threads", "1",
                    env={"REDIS_URL": f"redis://:{pw}@127.0.0.1:{free_port()}/0"}, timeout=25)
    assert code == 1 and "Error: the Redis URL holds the placeholder password" in out, out
    assert "Traceback" not in out and pw not in out


# --------------------------------------------------------------------------- booleans are not numbers

def test_booleans_and_strings_are_not_numbers():
    base = {"model": NOBODY, "prompt": "Hi"}
    for params, field in (({"max_tokens": True}, "max_tokens"), ({"temperature": False}, "temperature"),
                          ({"temperature": "0.5"}, "temperature"), ({"seed": True}, "seed"),
                          ({"top_k": True}, "top_k"), ({"end_at_sentence": 1}, "end_at_sentence"),
                          ({"max_tokens": 2.0}, "max_tokens")):
        with pytest.raises(InvalidJob, match=rf"^{field}: Input should be a valid"):
            validate_job({**base, "params": params})
    job = validate_job({**base, "params": {"temperature": 1, "max_tokens": 5, "seed": 3, "end_at_sentence": True}})
    assert (job.params.temperature, job.params.max_tokens, job.params.seed) == (1.0, 5, 3)

    def batch_line(**body) -> dict:
        return {"custom_id": "c", "url": "/v1/chat/completions",
                "body": {"model": NOBODY, "messages": [{"role": "user", "content": "Hi"}], **body}}

    for body, needle in (({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
                         ({"max_completion_tokens": True}, "max_tokens"),
                         ({"n": True}, "n=True"), ({"stream": 0}, "stream=0"), ({"best_of": 1.0}, "best_of=1.0")):
        with pytest.raises(InvalidJob, match=re.escape(needle)):
            request_to_job(batch_line(**body))
    assert request_to_job(batch_line(n=1, stream=False, max_tokens=3)).params.max_tokens == 3


def test_the_api_refuses_a_boolean_max_tokens(tc: TestClient):
    r = tc.post("/v1/chat/completions", headers=auth(),
                json={"model": NOBODY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": True})
    assert r.status_code == 400 and "max_tokens: Input should be a valid integer (got True)" in \
        r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_tokens"
    b = create_batch(tc, upload(tc, line("t", max_tokens=True) + "\n" + line("ok", max_tokens=3))["id"]).json()
    got = wait_status(tc, b["id"], ("in_progress", "failed"))
    assert got["request_counts"]["failed"] == 1 and [e["line"] for e in got["errors"]["data"]] == [1]


# --------------------------------------------------------------------------- upload filenames

def test_upload_filenames_are_reduced_to_a_safe_basename(tc: TestClient, client):  # noqa: F811
    for given, stored in (("../../x", "x"), ("..", "upload.jsonl"), ("dir\\sub\\in.jsonl", "in.jsonl"),
                          ("/etc/passwd", "passwd"), ("  ", "upload.jsonl")):
        f = upload(tc, line("a"), filename=given)
        assert f["filename"] == stored, (given, f)
        assert tc.get(f"/v1/files/{f['id']}", headers=auth()).json()["filename"] == stored
    # NUL and other control characters, as a client can put them into a multipart header
    boundary = "b0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"../a\x00b\x1b.jsonl\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n{line('a')}\r\n--{boundary}--\r\n").encode()
    r = tc.post("/v1/files", headers={**auth(), "Content-Type": f"multipart/form-data; boundary={boundary}"},
                content=body)
    assert r.status_code == 200, r.text
    assert r.json()["filename"] == "ab.jsonl"
    disposition = tc.get(f"/v1/files/{r.json()['id']}/content", headers=auth()).headers["content-disposition"]
    assert "ab.jsonl" in disposition and "\x00" not in disposition and ".." not in disposition
    # a record stored before names were reduced is shown reduced
    client.connection.hset(keys.api_file_key(r.json()["id"]), "filename", json.dumps("../../old\x00name"))
    assert tc.get(f"/v1/files/{r.json()['id']}", headers=auth()).json()["filename"] == "oldname"

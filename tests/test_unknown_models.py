"""Unknown models fail fast.

A line or request naming a model that no live worker holds and engine.registry does not know fails at
validation with model_not_found: in the API (its line in the batch's error file), in `rqllm submit`
(refused with its line number, also with --wait) and in `rqllm summarize`. A model name becomes a queue
name only when it is a valid one: "../../etc/passwd" creates no `rq:queue:rqllm:passwd:default`.

Real Redis; the API runs in-process (Starlette's TestClient, its batch runners included); `rqllm submit`
is the real command in a subprocess; the mixed batch runs on a real SmolLM2 worker.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from redis import Redis

from engine.model import SUPPORTED_ARCHS
from jobs.schemas import InvalidJob, model_key, queue_name, validate_job
from pipeline.api.app import create_app
from pipeline.api.config import ServeConfig
from pipeline.batch_file import MODEL_NOT_FOUND, parse_lines
from pipeline.client import Client
from pipeline.model_check import ModelCheck
from tests.conftest_redis import client, redis_server, redis_url, spawn_worker, wait_for_workers  # noqa: F401
from tests.model_available import needs_model

ROOT = Path(__file__).resolve().parent.parent
M = "smollm2-135m"
KNOWN_UNSERVED = "qwen2.5-coder-1.5b-instruct"  # known to the registry, held by no worker here
KEY = "unknown-models-key-1"
UNKNOWN = "no-such-model"
PATHLIKE = "../../etc/passwd"


def line(cid: str, model: str, content: str = "Say hi.", max_tokens: int = 2) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "user", "content": content}],
                                "max_tokens": max_tokens}})


def queue_keys(conn: Redis) -> list[str]:
    return sorted(k.decode() for k in conn.keys("rq:queue:*"))


def strange_keys(conn: Redis) -> list[str]:
    return sorted(k.decode() for k in conn.keys("*") if b"passwd" in k or UNKNOWN.encode() in k)


# --------------------------------------------------------------------------- names

def test_a_model_name_is_a_queue_name_only_when_valid():
    assert model_key("SmolLM2-135M") == "smollm2-135m"
    assert model_key("/models/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4_1"
    assert queue_name("qwen2.5-coder-0.5b-instruct") == "rqllm:qwen2.5-coder-0.5b-instruct:default"
    for bad in (PATHLIKE, "..", "a b", "x:y", "*", "mo\x00del", "/models/", ".hidden", "a" * 129, "/x/-.gguf"):
        with pytest.raises(InvalidJob, match="model"):
            model_key(bad)
    with pytest.raises(InvalidJob, match=r"model: model '\.\./\.\./etc/passwd' is neither a model name"):
        validate_job({"model": PATHLIKE, "prompt": "Hi"})


def test_a_path_like_model_creates_no_queue_key(client: Client):  # noqa: F811
    with pytest.raises(InvalidJob, match="etc/passwd"):
        client.submit_batch([{"model": PATHLIKE, "prompt": "Hi", "custom_id": "a"}])
    with pytest.raises(InvalidJob):
        client.submit({"model": PATHLIKE, "prompt": "Hi"})
    assert queue_keys(client.connection) == [] and strange_keys(client.connection) == []


def test_model_check_knows_live_workers_the_registry_and_files(client: Client, tmp_path: Path):  # noqa: F811
    from jobs.schemas import queue_names
    from pipeline.worker import LLMWorker

    check = ModelCheck.live(client)
    assert check(M) is None and check("SmolLM2-135M") is None and check(KNOWN_UNSERVED) is None
    why = check(UNKNOWN)
    assert why is not None and "not served by any live worker (they hold: none)" in why and M in why
    assert "neither a model name" in check(PATHLIKE)
    holder = LLMWorker(queue_names("custom-model"), model="custom-model", connection=client.connection, name="holder")
    holder.register_birth()
    try:
        assert ModelCheck.live(client)("custom-model") is None  # a live worker holds it
        assert check("custom-model") is not None  # a check made before the worker started does not know it
    finally:
        holder.register_death()
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF")
    assert ModelCheck(files=True)(str(gguf)) is None and ModelCheck()(str(gguf)) is not None
    assert ModelCheck(files=True)(str(tmp_path / "absent.gguf")) is not None


def test_parse_lines_refuses_an_unknown_model_alone_with_its_code():
    lines = [line("a", M), line("b", UNKNOWN), line("c", PATHLIKE), line("d", KNOWN_UNSERVED)]
    jobs, errors = parse_lines(lines, check_model=ModelCheck())
    assert [j.custom_id for j in jobs] == ["a", "d"]
    assert [(e.lineno, e.custom_id, e.code) for e in errors] == [(2, "b", MODEL_NOT_FOUND), (3, "c", MODEL_NOT_FOUND)]
    assert str(errors[0]).startswith("line 2 (b): model_not_found: model 'no-such-model' is not served")


# --------------------------------------------------------------------------- the API

def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def tc(redis_url: str, tmp_path: Path) -> Iterator[TestClient]:  # noqa: F811
    with TestClient(create_app(ServeConfig(redis_url=redis_url, data_dir=tmp_path / "data", api_keys=[KEY]))) as c:
        yield c


def create_batch(tc: TestClient, text: str) -> dict:
    r = tc.post("/v1/files", headers=auth(), files={"file": ("in.jsonl", text.encode())}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    r = tc.post("/v1/batches", headers=auth(), json={"input_file_id": r.json()["id"],
                                                     "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert r.status_code == 200, r.text
    return r.json()


def wait_status(tc: TestClient, batch_id: str, statuses: tuple[str, ...], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        b = tc.get(f"/v1/batches/{batch_id}", headers=auth()).json()
        if b["status"] in statuses:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} is still {b['status']} after {timeout} s"
        time.sleep(0.05)


def content(tc: TestClient, file_id: str) -> list[dict]:
    return [json.loads(x) for x in tc.get(f"/v1/files/{file_id}/content", headers=auth()).text.splitlines()]


def test_a_batch_of_unknown_models_fails_at_validation_and_queues_nothing(tc: TestClient, redis_url: str):  # noqa: F811
    b = wait_status(tc, create_batch(tc, line("b", UNKNOWN) + "\n" + line("c", PATHLIKE) + "\n")["id"],
                    ("failed",), timeout=20)
    listed = {e["line"]: e for e in b["errors"]["data"] if e["line"]}
    assert {n: e["code"] for n, e in listed.items()} == {1: MODEL_NOT_FOUND, 2: MODEL_NOT_FOUND}
    assert "'no-such-model' is not served by any live worker" in listed[1]["message"]
    assert b["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    conn = Redis.from_url(redis_url)
    assert queue_keys(conn) == [] and strange_keys(conn) == []


@needs_model(M)
def test_an_unknown_model_line_ends_as_model_not_found_in_the_error_file(tc: TestClient, client: Client,  # noqa: F811
                                                                         spawn_worker):  # noqa: F811
    """The acceptance test: the batch ends (completed), the good line in the output file, the unknown and
    the path-like lines in the error file with model_not_found and their line numbers."""
    w = spawn_worker(M, name="unknown-models-w1")
    wait_for_workers(client.connection, [w.name])
    text = "\n".join([line("good", M), line("unknown", UNKNOWN), line("pathlike", PATHLIKE)]) + "\n"
    b = wait_status(tc, create_batch(tc, text)["id"], ("completed", "failed", "expired", "cancelled"), timeout=240)
    assert b["status"] == "completed", b
    assert b["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    out = content(tc, b["output_file_id"])
    assert [x["custom_id"] for x in out] == ["good"] and out[0]["response"]["status_code"] == 200
    errors = {x["custom_id"]: x["error"] for x in content(tc, b["error_file_id"])}
    assert {cid: (e["code"], e["line"]) for cid, e in errors.items()} == {
        "unknown": (MODEL_NOT_FOUND, 2), "pathlike": (MODEL_NOT_FOUND, 3)}
    assert all(k.startswith(f"rq:queue:rqllm:{model_key(M)}:") for k in queue_keys(client.connection))
    assert strange_keys(client.connection) == []


# --------------------------------------------------------------------------- rqllm submit

def rqllm(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    full["PYTHONPATH"] = str(ROOT)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)


def test_submit_refuses_unknown_model_lines_with_their_numbers(redis_url: str, tmp_path: Path):  # noqa: F811
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([line("good", M), line("unknown", UNKNOWN), line("pathlike", PATHLIKE)]) + "\n")
    p = rqllm("submit", str(path), env={"REDIS_URL": redis_url})
    assert p.returncode == 1, p.stderr  # submitted, but not all of it
    assert f"refused: {path}: line 2 (unknown): model_not_found: model 'no-such-model' is not served" in p.stderr
    assert f"refused: {path}: line 3 (pathlike): model_not_found: model '../../etc/passwd' is neither" in p.stderr
    batch_id = p.stdout.strip()
    c = Client(redis_url)
    assert [cid for cid, _ in c.batch_entries(batch_id)] == ["good"]
    assert strange_keys(c.connection) == []


def test_submit_wait_refuses_an_unknown_model_before_starting_anything(tmp_path: Path):
    """Without REDIS_URL, --wait would start a private Redis and a worker for the model: refused first."""
    path = tmp_path / "in.jsonl"
    path.write_text(line("only", UNKNOWN) + "\n")
    t0 = time.monotonic()
    p = rqllm("submit", "--wait", str(path), timeout=60)
    assert p.returncode == 1
    (said,) = p.stderr.strip().splitlines()  # one line
    assert said.startswith(f"Error: nothing to submit: {path}: line 1 (only): model_not_found: model 'no-such-model'")
    lit = rqllm("submit", "--wait", "--literal", "--model", UNKNOWN, "Hello", timeout=60)
    assert lit.returncode == 1 and lit.stderr.strip().splitlines() == [
        f"Error: nothing to submit: prompt-1: model_not_found: {ModelCheck.live(None, files=True)(UNKNOWN)}"]
    assert time.monotonic() - t0 < 30


# --------------------------------------------------------------------------- rqllm summarize

def test_summarize_refuses_an_unknown_model(redis_url: str, tmp_path: Path):  # noqa: F811
    from pipeline.summarize import summarize
    from pipeline.summarize.errors import SummarizeError

    doc = tmp_path / "doc.md"
    doc.write_text("# A document\n\nSome text to summarise.\n")
    for model in (UNKNOWN, PATHLIKE, str(tmp_path / "absent.gguf")):
        with pytest.raises(SummarizeError, match="model_not_found"):
            summarize([str(doc)], output=io.StringIO(), model=model, redis_url=redis_url,
                      progress_stream=io.StringIO())
    conn = Redis.from_url(redis_url)
    assert queue_keys(conn) == [] and strange_keys(conn) == []
    p = rqllm("summarize", str(doc), "--model", UNKNOWN, env={"REDIS_URL": redis_url})
    assert p.returncode == 1 and "Error: model_not_found: model 'no-such-model'" in p.stderr
    assert "Traceback" not in p.stderr


# --------------------------------------------------------------------------- a .gguf of an unknown architecture

@pytest.fixture
def mamba_gguf(smollm2_path: Path, tmp_path: Path) -> Path:
    """The real SmolLM2 file with general.architecture renamed to 'mamba' (same length, so it still parses)."""
    data = smollm2_path.read_bytes()
    at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8  # past the type and length
    assert data[at:at + 5] == b"llama"
    path = tmp_path / "mamba-135m.gguf"
    path.write_bytes(data[:at] + b"mamba" + data[at + 5:])
    return path


UNSUPPORTED = f"unsupported architecture 'mamba'; supported: {', '.join(SUPPORTED_ARCHS)}"


@pytest.mark.parametrize("remote", [False, True], ids=["embedded", "REDIS_URL"])
def test_summarize_refuses_an_unknown_architecture_in_one_line(mamba_gguf: Path, tmp_path: Path, redis_url: str,  # noqa: F811
                                                                remote: bool):
    doc = tmp_path / "doc.md"
    doc.write_text("# A document\n\nSome text to summarise.\n")
    t0 = time.monotonic()
    p = rqllm("summarize", str(doc), "--model", str(mamba_gguf), env={"REDIS_URL": redis_url} if remote else None,
              timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [f"Error: cannot use the model: {mamba_gguf}: {UNSUPPORTED}"], p.stderr
    assert time.monotonic() - t0 < 30
    assert queue_keys(Redis.from_url(redis_url)) == []


def test_submit_wait_refuses_an_unknown_architecture_before_starting_anything(mamba_gguf: Path):
    t0 = time.monotonic()
    p = rqllm("submit", "--wait", "--literal", "--model", str(mamba_gguf), "Hello", timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [f"Error: cannot use the model: {mamba_gguf}: {UNSUPPORTED}"], p.stderr
    assert time.monotonic() - t0 < 30

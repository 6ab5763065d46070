"""Structured outputs through `rqllm serve` with the official openai client: response_format in a chat
completion (json_schema, json_object, the client's own pydantic `parse`), in a completion and in Batch
lines; a schema that does not compile is refused at submission (400, param response_format; a batch
line with its line number), never at a worker. Real Redis, a real SmolLM2 worker, no mocks."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel, Field
from redis import Redis

from pipeline.embedded import WorkerProcess, stop_workers, worker_argv
from tests.api_server import ServeProcess
from tests.conftest_redis import wait_for_workers
from tests.model_available import needs_model
from tests.redis_server import redis_server  # noqa: F401  (session fixture)
from tests.structured_cases import SCHEMAS, check_output, messages, response_format
from tests.test_api_integration import file_lines, wait_batch, write_jsonl

openai = pytest.importorskip("openai", reason="the openai client is in the test extras: pip install -e '.[test]'")

M = "smollm2-135m"
KEY = "key-json-" + "c" * 16
BAD_SCHEMA = {"type": "object", "properties": {"n": {"type": "integr"}}}
pytestmark = needs_model(M)


@pytest.fixture(scope="module")
def client(redis_server: str, tmp_path_factory) -> Iterator:  # noqa: F811
    Redis.from_url(redis_server).flushdb()
    base = tmp_path_factory.mktemp("api-json")
    worker = WorkerProcess(worker_argv(redis_server, M, threads=2, name="json-w1"), str(base / "w.log"))
    server = ServeProcess(base / "data", redis_url=redis_server, keys=[KEY]).start()
    try:
        wait_for_workers(Redis.from_url(redis_server), ["json-w1"])
        server.wait_ready(KEY, models=True)
        yield server.openai(KEY)
    finally:
        server.stop()
        stop_workers([worker])


def test_chat_completion_with_a_json_schema(client):
    complete = 0
    for name in ("nested", "enum", "bounded_numbers"):
        r = client.chat.completions.create(model=M, messages=messages(name), max_tokens=100,
                                           response_format=response_format(name))
        complete += check_output(r.choices[0].message.content, r.choices[0].finish_reason, SCHEMAS[name])
    assert complete >= 2


def test_json_object_and_the_clients_parse(client):
    r = client.chat.completions.create(model=M, max_tokens=80, response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": "Describe a cat as a JSON object."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)

    class Ticket(BaseModel):
        product: str = Field(max_length=30)
        severity: int = Field(ge=1, le=5)

    parsed = client.chat.completions.parse(model=M, messages=messages("enum"), max_tokens=80, response_format=Ticket)
    ticket = parsed.choices[0].message.parsed
    assert isinstance(ticket, Ticket) and 1 <= ticket.severity <= 5


def test_completion_with_a_regex_and_streaming(client):
    fmt = {"type": "regex", "regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}
    r = client.completions.create(model=M, prompt="Today's date:", max_tokens=20,
                                  extra_body={"response_format": fmt})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) == 10
    pieces = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=M, messages=messages("pattern"), max_tokens=60, response_format=response_format("pattern"),
        stream=True) if ch.choices]
    check_output("".join(pieces), "stop", SCHEMAS["pattern"])


def test_bad_schema_refused_at_submission(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=M, messages=messages("enum"), max_tokens=10, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}})
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
    assert "integr" in e.value.body["message"]


def test_batch_lines_with_response_format(client, tmp_path: Path):
    def line(custom_id: str, name: str, fmt: dict) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": M, "messages": messages(name), "max_tokens": 100, "response_format": fmt}}

    names = ("nested", "array", "pattern", "optional_fields")
    lines = [line(n, n, response_format(n)) for n in names]
    lines.append(line("bad", "enum", {"type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}}))
    src = client.files.create(file=write_jsonl(tmp_path / "in.jsonl", lines).open("rb"), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "completed", b
    refused = {e.line: e for e in b.errors.data}
    assert set(refused) == {5} and refused[5].param == "response_format" and "integr" in refused[5].message
    out = {x["custom_id"]: x["response"]["body"]["choices"][0] for x in file_lines(client, b.output_file_id)}
    assert set(out) == set(names)
    complete = sum(check_output(c["message"]["content"], c["finish_reason"], SCHEMAS[n]) for n, c in out.items())
    assert complete >= 3

"""A refused field reads the same everywhere: "max_tokens: Input should be ... (got 0)".

Before, `submit` said "1 validation error for GenerationJob: params.max_tokens: ...", `generate` said
"max_tokens: Input should be ..." without the value, and the API's error had `param: null`. Now the
field is named as a request names it (OpenAI's `param` form: "max_tokens", "messages.[0].role") in the
message of every producer, and the API's `param` is that same path.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from jobs.schemas import InvalidJob, validate_job
from pipeline.api.app import create_app
from pipeline.api.config import ServeConfig
from pipeline.batch_file import parse_lines
from tests.conftest_redis import redis_server, redis_url  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from pipeline.cli import main; main()"]
NOBODY = "qwen2.5-coder-1.5b-instruct"  # known to the registry, held by no worker here
KEY = "wording-key-123456"
MAX_TOKENS_0 = "max_tokens: Input should be greater than or equal to 1 (got 0)"
BAD_ROLE = "messages.[0].role: Input should be 'system', 'user' or 'assistant' (got 'wizard')"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(CLI + list(args), cwd=ROOT, env=full, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tc(redis_url: str, tmp_path: Path) -> Iterator[TestClient]:  # noqa: F811
    with TestClient(create_app(ServeConfig(redis_url=redis_url, data_dir=tmp_path / "data", api_keys=[KEY]))) as c:
        yield c


def test_the_schema_names_the_field_as_a_request_does_and_sets_param():
    with pytest.raises(InvalidJob) as e:
        validate_job({"model": NOBODY, "prompt": "Hi", "params": {"max_tokens": 0}})
    assert (str(e.value), e.value.param) == (MAX_TOKENS_0, "max_tokens")
    with pytest.raises(InvalidJob) as e:
        validate_job({"model": NOBODY, "messages": [{"role": "wizard", "content": "Hi"}]})
    assert (str(e.value), e.value.param) == (BAD_ROLE, "messages.[0].role")


def test_generate_and_submit_say_it_in_the_same_words(redis_url):  # noqa: F811
    gen = _run("generate", "smollm2-135m", "Hi", "--max-tokens", "0")
    assert gen.returncode == 1 and gen.stderr.strip().splitlines() == [f"Error: {MAX_TOKENS_0}"], gen.stderr
    sub = _run("submit", "--literal", "--model", NOBODY, "--max-tokens", "0", "Hi", "Hello",
               env={"REDIS_URL": redis_url})
    assert sub.returncode == 1
    assert sub.stderr.splitlines() == [f"refused: prompt-1: {MAX_TOKENS_0}", f"refused: prompt-2: {MAX_TOKENS_0}",
                                       "Error: nothing to submit: all 2 lines were refused"], sub.stderr
    assert "validation error" not in sub.stderr and "GenerationJob" not in sub.stderr


def test_a_batch_file_line_names_the_field_and_its_param():
    body = {"model": NOBODY, "messages": [{"role": "wizard", "content": "Hi"}]}
    _, errors = parse_lines([json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                         "body": body})])
    assert [(e.message, e.param) for e in errors] == [(BAD_ROLE, "messages.[0].role")]
    _, errors = parse_lines([json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                                         "body": {**body, "messages": [{"role": "user", "content": "Hi"}],
                                                  "logit_bias": {}}})])
    assert [(e.message, e.param) for e in errors] == [("unsupported body field(s): logit_bias", "logit_bias")]


def test_the_api_sets_param_to_the_refused_field(tc: TestClient):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = tc.post("/v1/chat/completions", headers=auth,
                json={"model": NOBODY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0})
    assert r.status_code == 400
    assert (r.json()["error"]["message"], r.json()["error"]["param"]) == (MAX_TOKENS_0, "max_tokens")
    r = tc.post("/v1/chat/completions", headers=auth, json={"model": NOBODY, "messages": [{"role": "wizard",
                                                                                          "content": "Hi"}]})
    assert r.status_code == 400
    assert (r.json()["error"]["message"], r.json()["error"]["param"]) == (BAD_ROLE, "messages.[0].role")
    r = tc.post("/v1/completions", headers=auth, json={"model": NOBODY, "prompt": "Hi", "top_p": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"

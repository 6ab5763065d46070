"""`rqllm serve` end to end: the official openai client against a real server process, a real Redis and
real SmolLM2-135M workers (the production `python -m pipeline.cli_worker`). No mocks.

One server and two workers serve the whole module (starting them is the slow part); the restart test
runs a server of its own, which it kills and starts again. max_tokens stays small so the module is
quick on 2 cores.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis

from jobs import keys
from pipeline.api.batch_output import client_line
from pipeline.batch_view import line_counts
from pipeline.client import Client
from pipeline.embedded import WorkerProcess, stop_workers, worker_argv
from tests.api_server import ROOT, ServeProcess
from tests.conftest_redis import wait_for_workers
from tests.model_available import needs_model
from tests.redis_server import redis_server  # noqa: F401  (session fixture)

openai = pytest.importorskip("openai", reason="the openai client is in the test extras: pip install -e '.[test]'")

M = "smollm2-135m"
KEY1, KEY2 = "key-one-" + "a" * 16, "key-two-" + "b" * 16
QUESTIONS = ["Name a colour.", "Say hello.", "What is 2+2?", "Name a fruit.", "Name an animal.", "Say goodbye.",
             "Name a planet.", "Name a country.", "Name a tree.", "Name a river."]
LONG_PROMPT = "Count from 1 to 1000: 1, 2, 3, 4, 5,"  # the model keeps counting until max_tokens


pytestmark = needs_model(M)


class Stack:
    def __init__(self, redis_url: str, server: ServeProcess, workers: list[WorkerProcess]):
        self.redis_url = redis_url
        self.server = server
        self.workers = workers
        self.redis = Redis.from_url(redis_url)


@pytest.fixture(scope="module")
def stack(redis_server: str, tmp_path_factory) -> Iterator[Stack]:  # noqa: F811
    Redis.from_url(redis_server).flushdb()
    base = tmp_path_factory.mktemp("api")
    names = ["api-w1", "api-w2"]
    workers = []
    for name in names:
        w = WorkerProcess(worker_argv(redis_server, M, threads=1, name=name), str(base / f"{name}.log"))
        workers.append(w)
    server = ServeProcess(base / "data", redis_url=redis_server, keys=[KEY1, KEY2],
                          extra=["--max-body-bytes", "100000", "--max-file-bytes", "200000"]).start()
    try:
        wait_for_workers(Redis.from_url(redis_server), names)
        server.wait_ready(KEY1, models=True)
        yield Stack(redis_server, server, workers)
    finally:
        server.stop()
        stop_workers(workers)


def chat_line(custom_id: str, question: str, max_tokens: int = 8, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": M, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                     **body}}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def wait_batch(client, batch_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled", "expired"),
               timeout: float = 600.0, seen: list[str] | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if seen is not None and (not seen or seen[-1] != b.status):
            seen.append(b.status)
        if b.status in until:
            return b
        time.sleep(0.3)
    raise TimeoutError(f"batch {batch_id} still {b.status} after {timeout} s")


def file_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def test_batch_of_20_with_bad_lines(stack: Stack, tmp_path: Path):
    """Upload 20 lines (3 refused at validation, 1 failing in the worker), create, poll to completed,
    download both files: 20 lines in all, matched by custom_id, the bad ones in the error file."""
    c = stack.server.openai(KEY1)
    lines: list = [chat_line(f"q{i:02d}", QUESTIONS[i % len(QUESTIONS)]) for i in range(16)]
    lines.append(chat_line("bad-temperature", "Hi", temperature=-1))  # refused: temperature < 0
    lines.append(chat_line("bad-field", "Hi", logit_bias={"1": 2}))  # refused: unsupported field
    lines.append({**chat_line("bad-url", "Hi"), "url": "/v1/embeddings"})  # refused: another endpoint
    lines.append(chat_line("over-budget", "Hi", max_tokens=1_000_000))  # accepted, fails in the worker (KV budget)
    src = c.files.create(file=write_jsonl(tmp_path / "in.jsonl", lines).open("rb"), purpose="batch")
    assert src.purpose == "batch" and src.bytes == (tmp_path / "in.jsonl").stat().st_size

    seen: list[str] = []
    b = c.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"run": "twenty"})
    assert b.status == "validating" and b.metadata == {"run": "twenty"}
    b = wait_batch(c, b.id, seen=seen)
    assert b.status == "completed", b
    assert seen[-1] == "completed" and set(seen) <= {"validating", "in_progress", "finalizing", "completed"}
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (20, 16, 4)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.created_at <= b.completed_at
    refused = {e.line: e.message for e in b.errors.data}
    assert set(refused) == {17, 18, 19}
    assert "temperature" in refused[17] and "logit_bias" in refused[18] and "/v1/embeddings" in refused[19]

    out, err = file_lines(c, b.output_file_id), file_lines(c, b.error_file_id)
    assert len(out) + len(err) == 20
    assert sorted(x["custom_id"] for x in out) == [f"q{i:02d}" for i in range(16)]
    assert sorted(x["custom_id"] for x in err) == ["bad-field", "bad-temperature", "bad-url", "over-budget"]
    for x in out:
        body = x["response"]["body"]
        assert x["error"] is None and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] >= 1
    errors = {x["custom_id"]: x["error"] for x in err}
    assert errors["over-budget"]["code"] == "invalid_request" and "1000000" in errors["over-budget"]["message"]
    assert "line 17" in errors["bad-temperature"]["message"]
    usage_out = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    usage_in = sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)
    assert (b.usage.output_tokens, b.usage.input_tokens) == (usage_out, usage_in)
    assert b.usage.total_tokens == usage_in + usage_out

    # The output files are the caller's files; the other key sees none of them.
    own = {f.id for f in c.files.list()}
    assert {src.id, b.output_file_id, b.error_file_id} <= own
    assert [x.id for x in c.batches.list(limit=5)][0] == b.id

    # It is an rqllm batch: Client.batch_status and `rqllm collect` see it under the same id.
    # Content-addressed jobs: 16 lines ask 10 distinct questions, so 10 jobs serve them (+ over-budget).
    rq_client = Client(stack.redis_url)
    status = rq_client.batch_status(b.id)
    assert (status.requests, status.total, status.done, status.failed, status.refused) == (17, 11, 10, 1, 3)
    lines = line_counts(rq_client, status)  # what `rqllm status` shows: the API's request_counts
    assert (lines.lines, lines.done, lines.failed) == (20, 16, 4)
    collected = tmp_path / "collected.jsonl"
    p = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", "collect", b.id, "-o",
                        str(collected), "--no-progress", "--redis-url", stack.redis_url],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    cli = {json.loads(x)["custom_id"]: json.loads(x) for x in collected.read_text().splitlines()}
    assert set(cli) == {x["custom_id"] for x in out} | {"over-budget", "bad-temperature", "bad-field", "bad-url"}
    assert cli["bad-temperature"]["error"]["line"] == 17 and cli["bad-temperature"]["error"]["param"] == "temperature"
    # the same lines, less what only operators see (the worker, its timings, prefix-cache hits)
    assert all(client_line(cli[x["custom_id"]])["response"] == x["response"] for x in out)
    assert all(set(x["response"]["body"]["rqllm"]) == {"job_id"} for x in out)
    assert "prefix_hit_tokens" in cli["q00"]["response"]["body"]["rqllm"]


def test_streaming_deltas_equal_non_streaming_text(stack: Stack):
    """Same request and seed: the streamed deltas concatenate to the non-streaming text. The result of the
    first is deleted before the second, so the second is generated again (not served from the result)."""
    c = stack.server.openai(KEY1)
    req = dict(model=M, messages=[{"role": "user", "content": "Write a long story about the sea."}], max_tokens=96,
               temperature=0.8, seed=1234)
    first = c.chat.completions.create(**req)
    text = first.choices[0].message.content
    assert text and first.usage.completion_tokens >= 1
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    job_id = first.id.removeprefix("chatcmpl-")
    first_end = json.loads(stack.redis.get(keys.result_key(job_id)))["ended_at"]
    assert stack.redis.delete(keys.result_key(job_id)) == 1

    deltas, finish, usage, ids = [], None, None, set()
    for chunk in c.chat.completions.create(**req, stream=True, stream_options={"include_usage": True}):
        ids.add(chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(deltas) == text
    assert len(deltas) >= 2 and first.usage.completion_tokens >= 32  # it streamed, not one piece at the end
    assert finish == first.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == first.usage.completion_tokens
    assert ids == {first.id}
    again = json.loads(stack.redis.get(keys.result_key(job_id)))
    assert again["ended_at"] > first_end and again["text"] == text  # generated a second time

    # /v1/completions too, with OpenAI's include_usage chunk (no choices) at the end
    chunks = list(c.completions.create(model=M, prompt="The capital of France is", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    plain = c.completions.create(model=M, prompt="The capital of France is", max_tokens=6)
    assert streamed == plain.choices[0].text and plain.usage.completion_tokens == chunks[-1].usage.completion_tokens


def test_keys_401_and_404_for_another_keys_objects(stack: Stack, tmp_path: Path):
    owner, other = stack.server.openai(KEY1), stack.server.openai(KEY2)
    src = owner.files.create(file=write_jsonl(tmp_path / "one.jsonl", [chat_line("only", "Say hi.", 4)]).open("rb"),
                             purpose="batch")
    b = owner.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions", completion_window="24h")

    with pytest.raises(openai.AuthenticationError) as e:
        stack.server.openai("not-a-key").batches.retrieve(b.id)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.get(stack.server.base_url + "/files", timeout=10)  # no Authorization header at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"

    for call in (lambda: other.batches.retrieve(b.id), lambda: other.batches.cancel(b.id),
                 lambda: other.files.retrieve(src.id), lambda: other.files.content(src.id),
                 lambda: other.files.delete(src.id),
                 lambda: other.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.status_code == 404 and set(e.value.response.json()["error"]) == {"message", "type", "param",
                                                                                       "code"}
    assert b.id not in {x.id for x in other.batches.list()}
    assert src.id not in {f.id for f in other.files.list()}
    assert wait_batch(owner, b.id).status == "completed"  # untouched by the other key's cancel


def test_cancel_mid_batch(stack: Stack, tmp_path: Path):
    """Cancel once some lines are done: queued jobs never run, running ones stop, finished lines stay
    downloadable, and every line is in one of the two files."""
    c = stack.server.openai(KEY1)
    n = 12
    lines = [chat_line(f"c{i:02d}", f"{LONG_PROMPT} {i}", max_tokens=200) for i in range(n)]
    src = c.files.create(file=write_jsonl(tmp_path / "long.jsonl", lines).open("rb"), purpose="batch")
    b = c.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 600
    while c.batches.retrieve(b.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancelled = c.batches.cancel(b.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    b = wait_batch(c, b.id, timeout=300)
    assert b.status == "cancelled" and b.cancelled_at and b.completed_at is None
    out, err = file_lines(c, b.output_file_id), file_lines(c, b.error_file_id)
    assert len(out) >= 2 and len(out) + len(err) == n
    assert sorted(x["custom_id"] for x in out + err) == [f"c{i:02d}" for i in range(n)]
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
    assert (b.request_counts.completed, b.request_counts.failed) == (len(out), len(err))
    assert len(err) >= 4  # most were still queued: two workers cannot have started them all

    client = Client(stack.redis_url)
    ids = dict(client.batch_entries(b.id))
    deadline = time.monotonic() + 60
    while "started" in (statuses := [client.job_status(ids[x["custom_id"]]) for x in err]):
        assert time.monotonic() < deadline, "a running job of the cancelled batch was not stopped"
        time.sleep(0.1)  # its line is written at once; the worker stops it at its next token
    # queued ones were taken off the queue, running ones stopped ("finished": one that ended just then)
    assert set(statuses) <= {"canceled", "stopped", "finished"} and statuses.count("canceled") >= 2
    assert client.queue(M).count == 0
    assert c.batches.cancel(b.id).status == "cancelled"  # cancelling again changes nothing

    small = c.files.create(file=write_jsonl(tmp_path / "s.jsonl", [chat_line("s", "Hi", 2)]).open("rb"),
                           purpose="batch")
    done = wait_batch(c, c.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(done.id)  # a completed batch cannot be cancelled


def test_disconnected_stream_cancels_its_job(stack: Stack):
    c = stack.server.openai(KEY1)
    stream = c.chat.completions.create(model=M, messages=[{"role": "user", "content": LONG_PROMPT}],
                                       max_tokens=2000, stream=True)
    got = ""
    job_id = None
    for chunk in stream:
        job_id = chunk.id.removeprefix("chatcmpl-")
        if chunk.choices and chunk.choices[0].delta.content:
            got += chunk.choices[0].delta.content
            if len(got) > 10:
                break
    stream.close()
    deadline = time.monotonic() + 60
    while (raw := stack.redis.get(keys.result_key(job_id))) is None:
        assert time.monotonic() < deadline, "the job of a closed stream was not cancelled"
        time.sleep(0.2)
    result = json.loads(raw)
    assert result["status"] == "failed" and result["error"]["code"] == "cancelled"
    while Client(stack.redis_url).job_status(job_id) == "started":
        assert time.monotonic() < deadline, "the worker did not stop the job"
        time.sleep(0.2)
    assert Client(stack.redis_url).job_status(job_id) == "stopped"
    assert stack.redis.scard(keys.api_waiters_key(job_id)) == 0


def test_client_that_gives_up_waiting_cancels_its_job(stack: Stack):
    """Without streaming: a client that leaves (times out) before the answer cancels the job too."""
    from jobs.schemas import validate_job
    from pipeline.api.auth import owner_id
    from pipeline.batch_file import request_to_job

    body = {"model": M, "messages": [{"role": "user", "content": LONG_PROMPT + " 6, 7,"}], "max_tokens": 2000}
    # greedy and unseeded: the job id depends on the content and the key's owner id only, so the test can find it
    job = request_to_job({"custom_id": "any", "url": "/v1/chat/completions", "body": body})
    job_id = validate_job({**job.model_dump(exclude={"id"}), "owner": owner_id(KEY1)}).id
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.server.base_url + "/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.5),
                   headers={"Authorization": f"Bearer {KEY1}"})
    deadline = time.monotonic() + 60
    while (raw := stack.redis.get(keys.result_key(job_id))) is None:
        assert time.monotonic() < deadline, "the job of a client that left was not cancelled"
        time.sleep(0.2)
    result = json.loads(raw)
    assert result["status"] == "failed" and result["error"]["code"] == "cancelled"
    assert result["error"]["message"] == "the client disconnected before the request finished"


def test_errors_in_openai_shape_and_body_limit(stack: Stack, tmp_path: Path):
    c = stack.server.openai(KEY1)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=3)
    assert "n=3" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["code"] == "model_not_found"
    # Over the KV budget; the same content as the 20-line batch's "over-budget" line, so each request here
    # clears the failed result before and runs the job again (no spurious worker_error from the earlier run).
    too_long = dict(model=M, messages=[{"role": "user", "content": "Hi"}], max_tokens=1_000_000)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**too_long)
    assert e.value.body["code"] == "invalid_request" and "1000000" in e.value.body["message"]
    with pytest.raises(openai.APIError) as e:  # the same failure, as an error event in the stream
        list(c.chat.completions.create(**too_long, stream=True))
    assert e.value.body["code"] == "invalid_request"
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id="file-doesnotexist", endpoint="/v1/chat/completions",
                         completion_window="48h")  # type: ignore[arg-type]
    assert e.value.body["param"] == "completion_window"
    headers = {"Authorization": f"Bearer {KEY1}", "Content-Type": "application/json"}
    r = httpx.post(stack.server.base_url + "/chat/completions", headers=headers, timeout=30,
                   content=b'{"model": "' + b"x" * 150_000 + b'"}')  # over --max-body-bytes
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: refused while it is read
        for _ in range(15):
            yield b" " * 10_000
    r = httpx.post(stack.server.base_url + "/chat/completions", headers=headers, timeout=30, content=chunked())
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    big = write_jsonl(tmp_path / "big.jsonl", [chat_line(f"b{i}", "x" * 1000) for i in range(400)])  # ~450 KB
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=big.open("rb"), purpose="batch")
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=write_jsonl(tmp_path / "ft.jsonl", [chat_line("f", "Hi")]).open("rb"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    models = c.models.list().data
    assert [m.id for m in models] == [M] and c.models.retrieve(M).id == M
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gemma3-270m")  # a model of ours, but no live worker holds it
    assert set(models[0].model_dump()) == {"id", "object", "created", "owned_by"}  # no workers, hosts nor jobs


def test_server_killed_and_restarted_mid_batch(stack: Stack, tmp_path: Path):
    """SIGKILL the server while a batch runs, start it again on the same data dir: the batch completes,
    with every line exactly once."""
    server = ServeProcess(tmp_path / "data", redis_url=stack.redis_url, keys=[KEY1]).start()
    try:
        server.wait_ready(KEY1)
        c = server.openai(KEY1)
        n = 20
        lines = [chat_line(f"r{i:02d}", f"{LONG_PROMPT} {i}", max_tokens=96) for i in range(n)]
        src = c.files.create(file=write_jsonl(tmp_path / "r.jsonl", lines).open("rb"), purpose="batch")
        b = c.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 600
        while (done := c.batches.retrieve(b.id).request_counts.completed) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        server.kill()
        assert done < n, "the batch finished before the server could be killed mid-way"
        time.sleep(1)  # jobs go on meanwhile, with nobody collecting
        server.start()
        server.wait_ready(KEY1)
        c = server.openai(KEY1)
        assert c.files.retrieve(src.id).bytes == src.bytes
        b = wait_batch(c, b.id)
        assert b.status == "completed"
        out, err = file_lines(c, b.output_file_id), file_lines(c, b.error_file_id)
        assert err == [] and len(out) == n
        assert sorted(x["custom_id"] for x in out) == [f"r{i:02d}" for i in range(n)]
        assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (n, n, 0)
        assert b.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
        assert not (tmp_path / "data" / "batches" / b.id).exists()  # working files removed once finished
    finally:
        server.stop()


def test_stream_usage_once_and_only_when_asked(stack: Stack):
    """OpenAI's stream: no usage unless stream_options.include_usage; then once, in a last chunk with no
    choices (clients that add usage up must not count it twice)."""
    c = stack.server.openai(KEY1)
    req = dict(model=M, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6)
    plain = c.chat.completions.create(**req)
    chunks = list(c.chat.completions.create(**req, stream=True))
    assert chunks and all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    chunks = list(c.chat.completions.create(**req, stream=True, stream_options={"include_usage": True}))
    with_usage = [ch for ch in chunks if ch.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI refuses stream_options without a stream
        c.chat.completions.create(**req, stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


def test_logprobs_in_chat_completions_and_batch_lines(stack: Stack, tmp_path: Path):
    c = stack.server.openai(KEY1)
    req = dict(model=M, messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}], max_tokens=6)
    r = c.chat.completions.create(**req, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens >= 1
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 3
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)  # greedy: the likeliest
    assert c.chat.completions.create(**req).choices[0].logprobs is None  # not asked: none
    only = c.chat.completions.create(**req, logprobs=True).choices[0].logprobs.content
    assert [t.logprob for t in only] == [t.logprob for t in content] and all(t.top_logprobs == [] for t in only)

    # streamed: the same entries (they come with the finishing chunk)
    streamed = [t for ch in c.chat.completions.create(**req, logprobs=True, top_logprobs=3, stream=True)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]

    # legacy completions: logprobs=N
    done = c.completions.create(model=M, prompt="The capital of France is", max_tokens=5, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens
    assert "".join(lp.tokens) == done.choices[0].text
    assert all(len(alts) == 2 and max(alts.values()) == p for alts, p in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(done.choices[0].text) - len(lp.tokens[-1])

    for bad in (dict(top_logprobs=2), dict(logprobs=True, top_logprobs=21), dict(logprobs=1)):
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(**req, **bad)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=M, prompt="Hi", max_tokens=2, logprobs=6)  # OpenAI's limit is 5

    # a batch line asks for them the same way; the output line carries them
    lines = [chat_line("lp", "Is the sky blue? Answer yes or no.", 6, logprobs=True, top_logprobs=2),
             chat_line("plain", "Is the sky blue? Answer yes or no.", 6)]
    src = c.files.create(file=write_jsonl(tmp_path / "lp.jsonl", lines).open("rb"), purpose="batch")
    b = wait_batch(c, c.batches.create(input_file_id=src.id, endpoint="/v1/chat/completions",
                                       completion_window="24h").id)
    out = {x["custom_id"]: x["response"]["body"]["choices"][0] for x in file_lines(c, b.output_file_id)}
    assert out["plain"]["logprobs"] is None
    entries = out["lp"]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [t.token for t in content]
    assert [e["logprob"] for e in entries] == pytest.approx([t.logprob for t in content], abs=1e-6)
    assert all(len(e["top_logprobs"]) == 2 for e in entries)


def test_openai_ranges_routes_and_uploads(stack: Stack, tmp_path: Path):
    c = stack.server.openai(KEY1)
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=M, messages=msgs, max_tokens=2, temperature=2.5)  # OpenAI's range is 0..2
    assert "temperature" in e.value.body["message"]
    assert c.chat.completions.create(model=M, messages=msgs, max_tokens=2, temperature=2, seed=1).choices

    # unknown routes: OpenAI's own words and shape
    with pytest.raises(openai.NotFoundError) as e:
        c.embeddings.create(model=M, input="hello")
    assert e.value.response.json() == {"error": {"message": "Invalid URL (POST /v1/embeddings)",
                                                 "type": "invalid_request_error", "param": None, "code": None}}
    r = httpx.get(stack.server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY1}"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (GET /v1/chat/completions)"

    # a batch upload that is not JSONL is refused at upload, and nothing is kept
    before = {f.id for f in c.files.list()}
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("picture.png", png), purpose="batch")
    assert e.value.body["code"] == "invalid_file_format" and e.value.body["param"] == "file"
    assert "NUL" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("table.csv", b"custom_id,question\na,Hi\nb,Hello\n"), purpose="batch")
    assert "no line of it is a JSON object" in e.value.body["message"]
    assert {f.id for f in c.files.list()} == before

"""OpenAI Batch input parsing and output lines."""
from __future__ import annotations

import json

import pytest

from engine.defaults import DEFAULT_MODEL
from jobs.schemas import InvalidJob, JobResult, validate_job
from pipeline.batch_file import parse_lines, request_to_job
from pipeline.openai_format import output_line

M = "smollm2-135m"


def line(custom_id="r1", url="/v1/chat/completions", **body):
    body.setdefault("messages", [{"role": "user", "content": "Hi"}]) if url.endswith("chat/completions") else None
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_parse_good_and_bad_lines_with_numbers():
    lines = [
        line("a", model="gpt-4o-mini", max_tokens=8, temperature=0.5, top_p=0.9, seed=3, stop="\n"),
        line("b", url="/v1/completions", prompt="Once upon", max_tokens=4),
        "{not json",
        line("c", max_tokens=0),  # pydantic refuses
        "",
        line("a", max_tokens=8),  # duplicate custom_id
        line("d", url="/v1/embeddings"),
        line("e", tools=[{"type": "function"}]),
        line("f", n=2),
        line("g", n=1, stream=False, user="u1"),
        line("h", url="/v1/completions", prompt=["only one"]),
        line("i", url="/v1/completions", messages=[{"role": "user", "content": "x"}]),
    ]
    jobs, errors = parse_lines(lines, model=M)
    assert [j.custom_id for j in jobs] == ["a", "b", "g", "h"]
    a = jobs[0]
    assert a.model == M  # --model overrides body.model
    assert a.params.max_tokens == 8 and a.params.temperature == 0.5 and a.params.stop == ["\n"]
    assert a.params.seed == 3 and a.params.top_p == 0.9
    assert jobs[1].prompt == "Once upon" and jobs[1].endpoint == "/v1/completions"
    by_line = {e.lineno: e for e in errors}
    assert set(by_line) == {3, 4, 6, 7, 8, 9, 12}
    assert "invalid JSON" in by_line[3].message
    assert "max_tokens" in by_line[4].message and by_line[4].custom_id == "c"
    assert "already used on line 1" in by_line[6].message
    assert "url must be" in by_line[7].message
    assert "tools" in by_line[8].message
    assert "n=2" in by_line[9].message
    assert "takes `prompt`" in by_line[12].message
    assert str(by_line[4]).startswith("line 4 (c):")


def test_body_model_used_without_override():
    jobs, errors = parse_lines([line("a", model="gemma3-270m")])
    assert not errors and jobs[0].model == "gemma3-270m"
    jobs, _ = parse_lines([line("a")])
    assert jobs[0].model == DEFAULT_MODEL
    jobs, _ = parse_lines([line("a")], default_model=M)
    assert jobs[0].model == M


def test_output_lines():
    chat = validate_job({"model": M, "messages": [{"role": "user", "content": "Hi"}], "custom_id": "a"})
    r = JobResult(job_id=chat.id, status="done", model=M, endpoint=chat.endpoint, text="Hello!",
                  finish_reason="stop", prompt_tokens=5, completion_tokens=3, worker="w1")
    out = output_line("batch_1", "a", r)
    assert out["custom_id"] == "a" and out["error"] is None and out["id"].startswith("batch_req_")
    body = out["response"]["body"]
    assert out["response"]["status_code"] == 200 and out["response"]["request_id"] == chat.id
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello!"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}

    comp = r.model_copy(update={"endpoint": "/v1/completions"})
    body = output_line("batch_1", "a", comp)["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello!"

    failed = JobResult.failed(chat.id, "invalid_request", "prompt 10 + max_tokens 9000 exceeds 4096")
    out = output_line("batch_1", "a", failed)
    assert out["response"] is None
    assert out["error"] == {"code": "invalid_request", "message": "prompt 10 + max_tokens 9000 exceeds 4096"}
    json.dumps(out)


def test_request_to_job_requires_custom_id():
    import pytest

    from jobs.schemas import InvalidJob

    with pytest.raises(InvalidJob, match="custom_id"):
        request_to_job({"url": "/v1/completions", "body": {"prompt": "x"}})


def test_bad_bytes_and_huge_lines_are_line_errors_the_rest_is_kept(tmp_path, monkeypatch):
    from pipeline.batch_file import read_batch_file

    monkeypatch.delenv("RQLLM_MAX_PROMPT_BYTES", raising=False)
    good = line("ok", url="/v1/completions", prompt="Once upon").encode()
    huge = line("huge", url="/v1/completions", prompt="x" * (50 << 20)).encode()
    bad_utf8 = line("bytes", url="/v1/completions", prompt="caf!").encode().replace(b"caf!", b"caf\xe9")
    surrogate = b'{"custom_id": "sur", "url": "/v1/completions", "body": {"prompt": "a\\ud800b"}}'
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join([good, bad_utf8, huge, surrogate, good.replace(b'"ok"', b'"ok2"')]) + b"\n")
    jobs, errors = read_batch_file(path, model=M)
    assert [j.custom_id for j in jobs] == ["ok", "ok2"]
    by_line = {e.lineno: str(e) for e in errors}
    assert set(by_line) == {2, 3, 4}
    assert "line 2: not valid UTF-8: invalid continuation byte (byte 0xe9 at byte" in by_line[2]
    assert f"line 3: line is {len(huge) + 1:,} bytes, over the limit of 1,114,112 bytes" in by_line[3]
    assert "line 4 (sur):" in by_line[4] and "prompt is not valid UTF-8 text: surrogates not allowed" in by_line[4]
    # the limit is configurable
    monkeypatch.setenv("RQLLM_MAX_PROMPT_BYTES", str(100 << 20))
    jobs, errors = read_batch_file(path, model=M)
    assert "huge" in [j.custom_id for j in jobs]


def test_submit_reports_a_text_file_that_is_not_utf8_and_keeps_the_others(tmp_path):
    from pipeline.cli_jobs import _gather_jobs

    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Caf\xe9 cr\xe8me".encode("latin-1"))
    good = tmp_path / "good.txt"
    good.write_text("Summarise this sentence.", encoding="utf-8")
    jobs, errors = _gather_jobs((str(bad), str(good)), model=None, literal=False, raw=True, system=None,
                                params={"max_tokens": 4})
    assert [j.custom_id for j in jobs] == [str(good)]
    assert len(errors) == 1 and errors[0].custom_id == str(bad) and "not UTF-8" in str(errors[0])


def test_openai_penalties_and_the_ngram_guard_reach_the_job():
    line = {"custom_id": "p", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hi"}], "frequency_penalty": 0.5,
                     "presence_penalty": 0.25, "no_repeat_ngram_size": 4, "end_at_sentence": True}}
    params = request_to_job(line).params
    assert (params.frequency_penalty, params.presence_penalty, params.no_repeat_ngram_size,
            params.end_at_sentence) == (0.5, 0.25, 4, True)
    line["body"]["frequency_penalty"] = 3
    with pytest.raises(InvalidJob, match="frequency_penalty"):
        request_to_job(line)

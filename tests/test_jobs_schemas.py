"""Job/result schemas, content-derived ids, queue naming, the task allowlist (no Redis needed)."""
from __future__ import annotations

import pytest

from jobs.allowlist import check_function, is_allowed
from jobs.schemas import (
    GenerationJob,
    InvalidJob,
    JobResult,
    model_key,
    queue_name,
    queue_names,
    validate_job,
)

M = "smollm2-135m"


def job(**kw):
    data = {"model": M, "prompt": "Hello"}
    data.update(kw)
    return validate_job(data)


def test_id_is_content_derived_and_stable():
    a = job(custom_id="a", metadata={"x": 1}, batch_id="b1")
    b = job(custom_id="b", metadata={"y": 2})
    assert a.id == b.id  # custom_id, metadata, batch do not change the text
    assert a.id == job().id
    assert a.id.startswith("g") and len(a.id) == 41
    # explicit defaults hash like omitted ones
    assert job(params={"max_tokens": 256, "temperature": 0.0}).id == a.id


@pytest.mark.parametrize("change", [
    {"prompt": "Hello!"},
    {"model": "gemma3-270m"},
    {"params": {"max_tokens": 8}},
    {"params": {"seed": 1}},
    {"params": {"stop": ["\n"]}},
])
def test_id_changes_with_content(change):
    assert job(**change).id != job().id


def test_knobs_added_later_keep_earlier_ids_at_their_defaults():
    """Ids of jobs that do not use the anti-loop knobs are the ones computed before they existed
    (a resubmitted file finds its finished results)."""
    assert job().id == "g6258eee33cba946d09f5c3a2fd00cf2a7a9aaad3"
    assert job(params={"no_repeat_ngram_size": 0, "frequency_penalty": 0.0, "end_at_sentence": False}).id == job().id
    for knob in ({"no_repeat_ngram_size": 3}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.5},
                 {"end_at_sentence": True}):
        assert job(params=knob).id != job().id, knob


def test_chat_and_completion_ids_differ():
    chat = validate_job({"model": M, "messages": [{"role": "user", "content": "Hello"}]})
    assert chat.id != job().id
    assert chat.endpoint == "/v1/chat/completions" and job().endpoint == "/v1/completions"


def test_sampled_without_seed_is_keyed_by_custom_id():
    p = {"temperature": 0.8}
    assert job(params=p, custom_id="a").id != job(params=p, custom_id="b").id
    assert job(params=p, custom_id="a").id == job(params=p, custom_id="a").id
    seeded = {"temperature": 0.8, "seed": 7}
    assert job(params=seeded, custom_id="a").id == job(params=seeded, custom_id="b").id


def test_model_path_keys_by_stem():
    assert model_key("/root/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4_1"
    assert model_key("SmolLM2-135M") == "smollm2-135m"
    p = "/models/a.gguf"
    assert job(model=p).id == job(model="a.gguf").id  # same key -> same queue and id
    assert queue_name(M) == "rqllm:smollm2-135m:default"
    assert queue_names(M) == [f"rqllm:{M}:high", f"rqllm:{M}:default", f"rqllm:{M}:low"]
    with pytest.raises(InvalidJob):
        queue_name(M, "urgent")


@pytest.mark.parametrize("bad, needle", [
    ({"params": {"temperature": -1}}, "temperature"),
    ({"params": {"max_tokens": 0}}, "max_tokens"),
    ({"params": {"top_p": 0}}, "top_p"),
    ({"params": {"stop": [""]}}, "stop strings must not be empty"),
    ({"params": {"bogus": 1}}, "bogus"),
    ({"prompt": ""}, "prompt must not be empty"),
    ({"messages": [{"role": "user", "content": "x"}]}, "exactly one of"),
    ({"prompt": None}, "exactly one of"),
    ({"prompt": None, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"prompt": None, "messages": []}, "messages"),
    ({"model": ""}, "model"),
    ({"unexpected": True}, "unexpected"),
    ({"metadata": {"x": object()}}, "metadata"),
    ({"id": "gdeadbeef"}, "does not match"),
])
def test_invalid_jobs_refused_with_pydantic_message(bad, needle):
    data = {"model": M, "prompt": "Hello", **bad}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(InvalidJob) as e:
        validate_job(data)
    assert needle in str(e.value)
    assert "validation error" not in str(e.value) and "GenerationJob" not in str(e.value)  # no pydantic header


def test_content_parts_joined():
    g = validate_job({"model": M, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]})
    assert g.messages[0].content == "Hello"
    with pytest.raises(InvalidJob):
        validate_job({"model": M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})


def test_revalidates_mutated_models():
    g = job()
    g.params.temperature = -5  # pydantic does not validate assignment
    with pytest.raises(InvalidJob):
        validate_job(g)


def test_payload_roundtrip_is_json():
    import json

    g = job(custom_id="c", metadata={"k": [1, 2]})
    payload = g.to_payload()
    assert json.loads(json.dumps(payload)) == payload
    assert GenerationJob.model_validate(payload) == g


def test_result_schema():
    r = JobResult.failed("gx", "invalid_request", "too long")
    assert r.status == "failed" and r.error.code == "invalid_request"
    assert JobResult.model_validate_json(r.model_dump_json()) == r


def test_allowlist():
    assert is_allowed("jobs.tasks.generate")
    assert is_allowed("jobs.tasks.on_failure")
    assert is_allowed("jobs.summarize_tasks.summarize_chunk")
    assert is_allowed("jobs.summarize_tasks.reduce_summaries")
    for name in [
        "os.system",
        "builtins.eval",
        "jobs.tasks.os.system",  # attribute chains through an allowed module
        "jobs.tasks.get_current_job",  # imported into the module, not defined there
        "jobs.tasks.record_failure",  # defined there but not exported in __all__
        "jobs.tasks._retries_left",
        "jobs.tasks.TaskOptions",
        "jobs.runtime.run_generation",
        "jobs.tasks",
        "",
    ]:
        assert check_function(name), name


def test_prompt_size_limit_is_cheap_configurable_and_names_both_sizes(monkeypatch):
    import time

    monkeypatch.delenv("RQLLM_MAX_PROMPT_BYTES", raising=False)
    big = "x" * (50 << 20)
    t0 = time.process_time()
    with pytest.raises(InvalidJob, match=r"prompt is 52,428,800 bytes, over the limit of 1,048,576 bytes "
                                         r"\(set RQLLM_MAX_PROMPT_BYTES to change it\)"):
        validate_job({"model": M, "prompt": big})
    with pytest.raises(InvalidJob, match=r"message content is 52,428,800 bytes"):
        validate_job({"model": M, "messages": [{"role": "user", "content": big}]})
    assert time.process_time() - t0 < 0.5  # CPU seconds: no encoding or hashing of 50 MB
    two = [{"role": "user", "content": "é" * (300 << 10)}] * 2  # 2 x 600 KiB of UTF-8: each fits, not together
    with pytest.raises(InvalidJob, match=r"the chat messages together are 1,228,800 bytes, over the limit"):
        validate_job({"model": M, "messages": two})
    monkeypatch.setenv("RQLLM_MAX_PROMPT_BYTES", str(2 << 20))
    assert validate_job({"model": M, "messages": two}).messages[1].content == two[1]["content"]


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "   \n"}, "prompt: prompt must not be empty (it is only whitespace)"),
    ({"prompt": "a\ud800b"}, "prompt: prompt is not valid UTF-8 text: surrogates not allowed ('\\ud800') at character 1"),
    ({"prompt": None, "messages": [{"role": "user", "content": "\udfff"}]},
     "messages.[0].content: message content is not valid UTF-8 text"),
    ({"params": {"max_tokens": 10**9}}, "max_tokens: Input should be less than or equal to 1048576 (got 1000000000)"),
    ({"params": {"top_p": 1.5}}, "top_p: Input should be less than or equal to 1 (got 1.5)"),
])
def test_refusals_are_one_line_and_name_the_field(bad, message):
    data = {k: v for k, v in {"model": M, "prompt": "Hello", **bad}.items() if v is not None}
    with pytest.raises(InvalidJob) as e:
        validate_job(data)
    assert message in str(e.value) and "\n" not in str(e.value) and "errors.pydantic.dev" not in str(e.value)

"""Speculative decoding through the pipeline: job parameters (content ids, the Batch body), results
carrying draft_tokens / accepted_tokens, `rqllm generate --prompt-lookup / --draft` and a real
`rqllm worker --draft` serving jobs that ask for each mode."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from jobs.schemas import InvalidJob, JobResult, validate_job
from pipeline.batch_file import request_to_job
from pipeline.openai_format import output_line
from tests.conftest_redis import client, redis_conn, redis_server, redis_url, spawn_worker, wait_for_workers  # noqa: F401
from tests.quant_models import requantized

M = "smollm2-135m"


def _job(**params):
    return validate_job({"model": M, "prompt": "Hello", "params": params})


def test_greedy_jobs_share_their_id_whatever_the_speculation():
    plain = _job()
    assert _job(speculative="prompt_lookup").id == plain.id == _job(speculative="off").id == \
        _job(speculative="draft").id


def test_sampled_jobs_that_choose_a_speculation_get_their_own_id():
    seeded = {"temperature": 0.8, "seed": 3}
    assert _job(**seeded).id != _job(**seeded, speculative="prompt_lookup").id
    assert _job(**seeded, speculative="prompt_lookup").id != _job(**seeded, speculative="draft").id


def test_an_unknown_speculation_is_refused_naming_the_choices():
    with pytest.raises(InvalidJob, match="^speculative: .*'off', 'prompt_lookup' or 'draft'"):
        _job(speculative="medusa")


def test_batch_body_speculative_and_output_counts():
    line = {"custom_id": "a", "url": "/v1/completions",
            "body": {"model": M, "prompt": "Hi", "speculative": "prompt_lookup", "max_tokens": 4}}
    job = request_to_job(line)
    assert job.params.speculative == "prompt_lookup"
    result = JobResult(job_id=job.id, status="done", text="x", draft_tokens=12, accepted_tokens=7)
    extra = output_line("b", "a", result)["response"]["body"]["rqllm"]
    assert (extra["draft_tokens"], extra["accepted_tokens"]) == (12, 7)
    with pytest.raises(InvalidJob, match="speculative"):
        request_to_job({**line, "body": {**line["body"], "speculative": "yes"}})


def _cli(*args: str):
    from pipeline.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_generate_cli_speculative_flags(smollm2_path, monkeypatch):
    # Pinned pass costs: the CLI's engine times its passes once, at its one request, and on a busy
    # host that single timing can say guessing does not pay (it then rightly drafts nothing, and
    # this test would not see the flag reach the decoder).
    from engine.engine import Engine
    from engine.speculative import DEFAULT_PASS_COSTS

    monkeypatch.setattr(Engine, "pass_costs", property(lambda self: list(DEFAULT_PASS_COSTS)))
    base = ["generate", str(smollm2_path), "Count: 1, 2, 3, 4, 5,", "--max-tokens", "24", "--threads", "2",
            "--kv-budget", "16MiB", "--json"]
    plain = json.loads(_cli(*base).stdout)
    lookup = json.loads(_cli(*base, "--prompt-lookup").stdout)
    draft = json.loads(_cli(*base, "--draft", str(requantized(smollm2_path, "Q4_0"))).stdout)
    assert plain["ids"] == lookup["ids"] == draft["ids"]
    assert plain["draft_tokens"] == 0 and lookup["accepted_tokens"] > 0 and draft["draft_tokens"] >= 0
    both = _cli(*base, "--prompt-lookup", "--draft", str(smollm2_path))
    assert both.exit_code != 0 and "not both" in both.output


def test_generate_cli_refuses_a_draft_with_another_vocabulary(smollm2_path, gemma3_path):
    r = _cli("generate", str(smollm2_path), "Hi", "--draft", str(gemma3_path), "--kv-budget", "8MiB")
    assert r.exit_code != 0 and "cannot draft for" in r.output and "tokenizer.ggml.model" in r.output


def test_worker_with_a_draft_serves_every_mode(client, spawn_worker, smollm2_path):  # noqa: F811
    """A real worker started with --draft: greedy jobs asking for prompt lookup, the draft model or
    nothing (the worker's default: the draft) give plain greedy's text and report their guesses.

    The worker times its own passes at its first speculative requests (PassTimer), and on a busy
    host one timing can say that even guesses always kept would not pay: guessing then stays off
    for that request. So short warm-up jobs come first, until the costs are the median of
    PassTimer.REPEATS timings; and the jobs run PROBE_EVERY + 16 tokens, so that a policy whose
    costs say guessing does not pay (but could) still tries a guess. The worker runs one engine thread:
    with two on a 2-core host that another test keeps busy, each pass waits at every op for a thread
    the scheduler has put off, which makes the timed costs swing."""
    from engine.speculative import DraftPolicy, PassTimer
    from engine.engine import Engine
    from engine.params import SamplingParams

    draft = str(requantized(smollm2_path, "Q4_0"))
    w = spawn_worker(M, name="spec-w1", threads=1, kv_budget="32MiB", extra=["--draft", draft])
    prompts = {"lookup": "Count: 1, 2, 3, 4, 5,", "draft": "Count: 10, 11, 12, 13,",
               "default": "Count: 20, 21, 22, 23,", "off": "Count: 30, 31, 32, 33,"}
    modes = {"lookup": "prompt_lookup", "draft": "draft", "default": None, "off": "off"}
    n_tokens = DraftPolicy.PROBE_EVERY + 16
    jobs = [{"model": M, "prompt": p, "custom_id": k,
             "params": {"max_tokens": n_tokens, **({"speculative": modes[k]} if modes[k] else {})}}
            for k, p in prompts.items()]
    warm_up = [{"model": M, "prompt": f"Warm-up {i}: a, b, c, a, b,", "custom_id": f"warm-up-{i}",
                "params": {"max_tokens": 2, "speculative": "prompt_lookup"}} for i in range(PassTimer.REPEATS)]
    ids = {j["custom_id"]: validate_job(j).id for j in jobs}
    client.submit_batch(warm_up + jobs)
    wait_for_workers(client.connection, [w.name])
    results = {k: client.wait(jid, timeout=300) for k, jid in ids.items()}
    local = Engine(str(smollm2_path), threads=2, kv_budget="32MiB")
    for k, r in results.items():
        assert r.status == "done", (k, r.error)
        expected = local.generate(prompt=prompts[k], params=SamplingParams(max_tokens=n_tokens)).text
        assert r.text == expected, k
        assert 0 <= r.accepted_tokens <= r.draft_tokens
    assert results["off"].draft_tokens == 0
    log = open(w.log_path).read()
    costs = [line for line in log.splitlines() if "pass costs" in line]
    assert len(costs) == 1, "the worker logs the pass costs it timed once, after the warm-up jobs"
    assert results["lookup"].draft_tokens > 0 and results["lookup"].accepted_tokens > 0, costs
    assert "speculative decoding: draft by default, draft model" in log


def test_worker_start_check_counts_the_draft_and_refuses_another_vocabulary(smollm2_path, gemma3_path, monkeypatch):
    from pipeline import memory_guard

    draft = str(requantized(smollm2_path, "Q4_0"))
    with pytest.raises(memory_guard.MemoryGuardError, match="cannot draft for.*tokenizer.ggml.model"):
        memory_guard.check_worker_start(str(smollm2_path), "32MiB", draft=str(gemma3_path))
    alone = memory_guard.plan(str(smollm2_path), "32MiB")
    with_draft = memory_guard.plan(draft, 1 << 50, max_context=alone.kv_tokens)
    assert with_draft.kv_tokens == alone.kv_tokens  # the draft's cache holds as many tokens as the model's
    # room for the model alone, not for the draft too: refused, naming the draft
    monkeypatch.delenv(memory_guard.ENV_SKIP, raising=False)
    monkeypatch.setattr(memory_guard, "memory_limit", lambda: (alone.needed_bytes + 1, "a test limit"))
    memory_guard.check_worker_start(str(smollm2_path), "32MiB")
    with pytest.raises(memory_guard.MemoryGuardError, match="with the draft model .*Q4_0"):
        memory_guard.check_worker_start(str(smollm2_path), "32MiB", draft=draft)

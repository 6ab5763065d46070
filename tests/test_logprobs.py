"""Logprobs of generated tokens (engine.logprobs) on SmolLM2-135M: each token's log-probability is the
log-softmax of the model's logits at its position, recomputed here from one forward pass over prompt and
output with scipy; the alternatives are the most likely tokens there, best first; speculative decoding
and sampling report the same numbers for the same tokens; and OpenAI's shapes (chat, legacy completions)
are built from them."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax

from engine.engine import Engine
from engine.logprobs import token_text
from engine.speculative import MAX_DRAFT
from engine.params import SamplingParams
from jobs.schemas import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, JobResult
from pipeline.openai_format import response_body
from tests.model_available import needs_model

pytestmark = needs_model("smollm2-135m")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def eng(smollm2_path) -> Engine:
    return Engine(str(smollm2_path), threads=2, kv_budget="32MiB")


def expected_logprobs(eng: Engine, prompt_ids: list[int], out: list[int]) -> np.ndarray:
    """[len(out), vocab]: log-softmax of the logits predicting each output token, from one pass."""
    eng.forget_cache()  # the pass below overwrites the cache the engine would reuse
    logits = eng.model.forward_all(prompt_ids + out, 0)
    return log_softmax(logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(out)].astype(np.float64), axis=-1)


def test_greedy_logprobs_are_the_models_log_softmax(eng: Engine):
    gen = eng.generate(prompt=PROMPT, params=SamplingParams(max_tokens=12, logprobs=5))
    assert gen.logprobs is not None and len(gen.logprobs) == len(gen.ids) == 12
    want = expected_logprobs(eng, gen.prompt_ids, gen.ids)
    for i, (token, entry) in enumerate(zip(gen.ids, gen.logprobs)):
        assert entry.logprob == pytest.approx(want[i, token], abs=1e-4)
        best = np.argsort(-want[i])[:5]
        assert [a.bytes for a in entry.top_logprobs] == [list(eng.tokenizer.token_bytes(int(t))) for t in best]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(want[i, best].tolist(), abs=1e-4)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy took the most likely token
        assert bytes(entry.bytes) == eng.tokenizer.token_bytes(token)
    assert "".join(e.token for e in gen.logprobs) == gen.text
    assert eng.generate(prompt=PROMPT, params=SamplingParams(max_tokens=4)).logprobs is None


def test_top_zero_gives_the_chosen_tokens_only_and_sampling_reports_the_raw_distribution(eng: Engine):
    params = SamplingParams(max_tokens=10, logprobs=0, temperature=1.5, top_k=3, seed=7, repetition_penalty=1.3)
    gen = eng.generate(prompt=PROMPT, params=params)
    assert gen.logprobs is not None and all(e.top_logprobs == [] for e in gen.logprobs)
    want = expected_logprobs(eng, gen.prompt_ids, gen.ids)
    # before penalties, temperature and top-k: the model's own numbers
    assert [e.logprob for e in gen.logprobs] == pytest.approx([want[i, t] for i, t in enumerate(gen.ids)], abs=1e-4)


def test_speculative_decoding_reports_the_same_logprobs(eng: Engine):
    prompt = "Repeat after me: one two three four five six. Again: one two three four"
    plain = eng.generate(prompt=prompt, params=SamplingParams(max_tokens=16, logprobs=2))
    # every pass priced as one token's (as tests/test_speculative.py's EAGER): guesses whatever the host's load
    eng.set_speculation_costs([0.0] + [1.0] * (MAX_DRAFT + 1))
    guessed = eng.generate(prompt=prompt, params=SamplingParams(max_tokens=16, logprobs=2, speculative="prompt_lookup"))
    assert guessed.accepted_tokens > 0, "no guess was kept: the test would not cover verified rows"
    assert guessed.ids == plain.ids
    assert [e.logprob for e in guessed.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-4)
    assert [[a.token for a in e.top_logprobs] for e in guessed.logprobs] == \
        [[a.token for a in e.top_logprobs] for e in plain.logprobs]


def test_a_stop_at_eos_leaves_no_entry_for_it(eng: Engine):
    gen = eng.generate(messages=[{"role": "user", "content": "Say yes."}], params=SamplingParams(max_tokens=64, logprobs=1))
    assert gen.finish_reason == "stop" and len(gen.logprobs) == len(gen.ids)


def test_token_text_of_partial_characters():
    assert token_text(" Paris".encode()) == " Paris"
    assert token_text("é".encode()[:1]) == "bytes:\\xc3"


def test_openai_shapes(eng: Engine):
    gen = eng.generate(prompt=PROMPT, params=SamplingParams(max_tokens=5, logprobs=2))
    for endpoint in (ENDPOINT_CHAT, ENDPOINT_COMPLETIONS):
        result = JobResult(job_id="g1", status="done", endpoint=endpoint, text=gen.text, finish_reason="length",
                           prompt_tokens=gen.prompt_tokens, completion_tokens=5, logprobs=gen.logprobs)
        result = JobResult.model_validate_json(result.model_dump_json())  # as it travels through Redis
        lp = response_body(result)["choices"][0]["logprobs"]
        tokens = [e.token for e in gen.logprobs]
        if endpoint == ENDPOINT_CHAT:
            assert lp["refusal"] is None and [x["token"] for x in lp["content"]] == tokens
            assert set(lp["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}
            assert len(lp["content"][0]["top_logprobs"]) == 2
        else:
            assert lp["tokens"] == tokens and lp["token_logprobs"] == [e.logprob for e in gen.logprobs]
            assert lp["top_logprobs"][0] == {a.token: a.logprob for a in gen.logprobs[0].top_logprobs}
            assert lp["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]

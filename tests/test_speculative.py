"""Speculative decoding on the real models: greedy output is plain greedy's token for token (prompt
lookup and a draft model: a Q4_0 requantisation of the target), stop strings, max_tokens, EOS,
streaming and the KV budget behave as without it, and rolled-back K/V across a sliding-window ring
boundary (Gemma 3) leaves no trace. The sampling rule's distribution is tested in
test_speculative_sampling.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine, EngineError
from engine.model import Model
from engine.params import SamplingParams
from engine.speculative import MAX_DRAFT
from tests.quant_models import requantized

ROOT = Path(__file__).resolve().parent.parent
# Every pass costs what one token's does: as many guesses as allowed in every round, so most
# rounds end in a rejection and a rollback.
EAGER = [0.0] + [1.0] * (MAX_DRAFT + 1)
# Shaped like the measured costs on 2 cores (bench/bench_speculative.py prints them): the adaptive
# draft lengths, but the same ones on every run.
MEASURED_LIKE = [0.0, 1.0, 1.05, 1.4, 1.52, 1.54, 1.62, 1.85, 2.09, 2.19, 2.22, 2.5, 2.72, 2.87, 2.97, 3.11, 3.15]
_ENGINES: dict[str, Engine] = {}


def engine_with_draft(path: Path) -> Engine:
    key = str(path)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(key, threads=2, kv_budget="64MiB", draft=requantized(path, "Q4_0"))
    return _ENGINES[key]


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> Engine:
    return engine_with_draft(smollm2_path)


def _excerpt(name: str, words: int) -> str:
    return " ".join((ROOT / "examples" / name).read_text().split()[:words])


def _summary(name: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a precise assistant that writes short, factual summaries."},
            {"role": "user", "content": "Summarize the following text in at most 60 words. Keep the key facts, "
                                        f"names, numbers and decisions.\n\nText:\n{_excerpt(name, 220)}"}]


PROMPTS = [  # (kwargs for generate, sampling overrides)
    ({"messages": _summary("history-of-the-telegraph.md")}, {"repetition_penalty": 1.1}),
    ({"messages": _summary("design-tiered-storage.md")}, {"repetition_penalty": 1.1}),
    ({"messages": _summary("team-sync-notes.md")}, {}),
    ({"messages": [{"role": "user", "content": "Write a short story about a dragon who bakes bread."}]}, {}),
    ({"messages": [{"role": "user", "content": "Explain how a refrigerator works."}]}, {"repetition_penalty": 1.3}),
    ({"prompt": "Count: 1, 2, 3, 4, 5,"}, {}),
    ({"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"}, {}),
    ({"prompt": "Répète trois fois : « naïve café », 東京タワー, 🎉 ; « naïve café », 東京タワー,"}, {}),
]


def _generate(eng: Engine, kwargs: dict, mode: str, **params):
    return eng.generate(**kwargs, params=SamplingParams(max_tokens=40, speculative=mode, **params))


# Gemma 3 (its sliding-window rings; a 262k vocabulary, so each of its passes costs 5x SmolLM2's)
# with the eager costs, which roll back the most; the adaptive lengths on SmolLM2.
@pytest.mark.parametrize("model,costs", [("smollm2_path", "eager"), ("smollm2_path", "adaptive"),
                                         ("gemma3_path", "eager")], ids=["smollm2-eager", "smollm2-adaptive", "gemma3-eager"])
def test_greedy_output_is_plain_greedy_token_for_token(request, model, costs):
    eng = engine_with_draft(request.getfixturevalue(model))
    eng.set_speculation_costs(EAGER if costs == "eager" else MEASURED_LIKE, 0.0 if costs == "eager" else 0.3)
    guessed = {"prompt_lookup": 0, "draft": 0}
    kept = dict(guessed)
    for kwargs, overrides in PROMPTS:
        plain = _generate(eng, kwargs, "off", **overrides)
        assert plain.draft_tokens == 0
        for mode in ("prompt_lookup", "draft"):
            spec = _generate(eng, kwargs, mode, **overrides)
            where = f"{mode} on {str(kwargs)[:60]}"
            assert spec.ids == plain.ids, where
            assert (spec.text, spec.finish_reason) == (plain.text, plain.finish_reason), where
            assert 0 <= spec.accepted_tokens <= spec.draft_tokens
            guessed[mode] += spec.draft_tokens
            kept[mode] += spec.accepted_tokens
    # The comparison means something only if guesses were checked, and kept and rejected both.
    for mode in guessed:
        assert 0 < kept[mode] < guessed[mode], (mode, kept[mode], guessed[mode])


# The anti-loop knobs read the history (generated tokens, guesses being checked): each guess must be
# judged with the history plain decoding would have at its position.
ANTI_LOOP = {"no_repeat_ngram_size": 3, "frequency_penalty": 0.4, "presence_penalty": 0.3, "repetition_penalty": 1.1}


# On SmolLM2: the guard and penalties are the sampler's, the same for every model (Gemma 3's rollbacks
# across its rings are checked above and below).
def test_greedy_output_with_the_guard_and_penalties_is_plain_greedy(smollm2, knobs=ANTI_LOOP):
    eng = smollm2
    eng.set_speculation_costs(EAGER, 0.0)
    changed = rejected = 0
    for kwargs, _ in PROMPTS:
        unguarded = _generate(eng, kwargs, "off")
        plain = _generate(eng, kwargs, "off", **knobs)
        changed += plain.ids != unguarded.ids
        for mode in ("prompt_lookup", "draft"):
            spec = _generate(eng, kwargs, mode, **knobs)
            where = f"{mode} on {str(kwargs)[:60]}"
            assert (spec.ids, spec.text, spec.finish_reason) == (plain.ids, plain.text, plain.finish_reason), where
            rejected += spec.draft_tokens - spec.accepted_tokens
    # Meaningful only if the knobs changed some outputs (prompt lookup then guesses the loop the
    # guard forbids) and guesses were rejected.
    assert changed >= 2 and rejected > 0, (changed, rejected)


def test_stop_strings_max_tokens_and_eos_behave_as_without_speculation(smollm2):
    smollm2.set_speculation_costs(EAGER, 0.0)
    count = {"prompt": "Count: 1, 2, 3, 4, 5,"}
    free = _generate(smollm2, count, "off")
    assert " 9," in free.text, free.text  # the premise: it counts on
    cases = [(count, {"stop": [" 9,"]}), (count, {"stop": ["7", " 12"]}), (count, {"max_tokens": 1}),
             (count, {"max_tokens": 2}), (count, {"max_tokens": 7}),
             ({"messages": [{"role": "user", "content": "Say hello."}]}, {"max_tokens": 64})]
    for kwargs, overrides in cases:
        params = {"max_tokens": 40, **overrides}
        plain_pieces: list[str] = []
        plain = smollm2.generate(**kwargs, params=SamplingParams(**params), on_text=plain_pieces.append)
        for mode in ("prompt_lookup", "draft"):
            pieces: list[str] = []
            spec = smollm2.generate(**kwargs, params=SamplingParams(speculative=mode, **params), on_text=pieces.append)
            assert (spec.ids, spec.text, spec.finish_reason, spec.completion_tokens) == \
                   (plain.ids, plain.text, plain.finish_reason, plain.completion_tokens), (mode, overrides)
            assert "".join(pieces) == spec.text
    chat = smollm2.generate(messages=[{"role": "user", "content": "Say hello."}],
                            params=SamplingParams(max_tokens=64, speculative="prompt_lookup"))
    assert chat.finish_reason == "stop" and "<|im_end|>" not in chat.text  # ended at EOS


def test_streamed_pieces_are_whole_characters_and_make_the_text(smollm2):
    smollm2.set_speculation_costs(EAGER, 0.0)
    prompt = {"prompt": "Répète : « naïve café », 東京タワー 🎉; « naïve café », 東京タワー 🎉; « naïve"}
    plain = _generate(smollm2, prompt, "off")
    pieces: list[str] = []
    spec = smollm2.generate(**prompt, params=SamplingParams(max_tokens=40, speculative="prompt_lookup"),
                            on_text=pieces.append)
    assert spec.text == plain.text and spec.accepted_tokens > 0
    assert "".join(pieces) == spec.text
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in plain.text


def test_should_stop_interrupts_and_the_engine_stays_consistent(smollm2):
    from engine.engine import EngineInterrupted

    smollm2.set_speculation_costs(EAGER, 0.0)
    calls = []
    with pytest.raises(EngineInterrupted):
        smollm2.generate(prompt="Count: 1, 2, 3,", params=SamplingParams(max_tokens=40, speculative="draft"),
                         should_stop=lambda: calls.append(1) or len(calls) > 2)
    assert len(calls) == 3
    again = _generate(smollm2, {"prompt": "Count: 1, 2, 3,"}, "draft")
    assert again.ids == _generate(smollm2, {"prompt": "Count: 1, 2, 3,"}, "off").ids


def test_a_request_filling_the_kv_cache_exactly(smollm2_path):
    eng = Engine(str(smollm2_path), threads=2, kv_budget="8MiB")
    eng.set_speculation_costs(EAGER)
    cap = eng.kv_capacity
    prompt = "Count: " + ", ".join(str(i) for i in range(1, 40)) + ","
    n = len(eng.prompt_ids(prompt))
    assert n + 8 < cap
    params = {"max_tokens": cap - n}
    plain = eng.generate(prompt=prompt, params=SamplingParams(**params))
    spec = eng.generate(prompt=prompt, params=SamplingParams(speculative="prompt_lookup", **params))
    assert spec.ids == plain.ids and spec.accepted_tokens > 0
    with pytest.raises(EngineError, match=f"capacity of {cap} tokens"):
        eng.generate(prompt=prompt, params=SamplingParams(speculative="prompt_lookup", max_tokens=cap - n + 1))


def test_sampled_generation_is_reproducible_with_a_seed(smollm2):
    smollm2.set_speculation_costs(MEASURED_LIKE, 0.3)
    for mode in ("prompt_lookup", "draft"):
        params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=42, speculative=mode)
        a = smollm2.generate(prompt="Count: 1, 2, 3, 4, 5,", params=params)
        b = smollm2.generate(prompt="Count: 1, 2, 3, 4, 5,", params=params)
        assert a.ids == b.ids and a.draft_tokens > 0


# --------------------------------------------------------------------------- sliding-window rings

def _text_ids(model: Model, n: int) -> list[int]:
    from engine.tokenizer import Tokenizer

    text = (ROOT / "examples" / "design-tiered-storage.md").read_text()
    ids = Tokenizer.from_gguf(model.gguf).encode(text)
    assert len(ids) >= n
    return ids[:n]


def test_rejected_guesses_across_a_ring_boundary_leave_no_trace(gemma3_path):
    """A 16-token pass of wrong guesses that wraps the local layers' rings (slot S-1 -> 0) with the
    window full, then a rollback to its first token: the following tokens' logits equal, bit for
    bit, those of a run that never saw the guesses. Twice: first and second wrap."""
    model = Model.load(gemma3_path, threads=2, kv_budget="64MiB")
    slots = min(k.shape[0] for k in model.kv.k)
    assert slots < model.capacity and slots > model.cfg.sliding_window  # local rings exist
    n = MAX_DRAFT + 1
    text = _text_ids(model, 2 * slots + 40)
    wrong = [int(t) for t in np.random.default_rng(0).integers(1000, 200000, size=n - 1)]
    for pos in (slots - 5, 2 * slots - 9):
        model.forward(text[:pos], 0)
        clean = model.forward_all(text[pos:pos + 12], pos)
        model.forward(text[:pos], 0)
        model.forward_all([text[pos], *wrong], pos)  # writes pos .. pos + n - 1 across the wrap
        after = model.forward_all(text[pos + 1:pos + 12], pos + 1)  # the rollback: pos + 1 is rewritten
        assert (pos % slots) + n > slots  # the guesses did cross the boundary
        assert np.array_equal(after, clean[1:]), f"rolled-back guesses changed the logits at {pos}"


def test_greedy_generation_across_the_ring_boundary(gemma3_path):
    eng = engine_with_draft(gemma3_path)
    eng.set_speculation_costs(EAGER, 0.0)
    slots = min(k.shape[0] for k in eng.model.kv.k)
    ids = _text_ids(eng.model, slots - 20)
    plain = eng.generate(prompt_ids=ids, params=SamplingParams(max_tokens=60))
    for mode in ("prompt_lookup", "draft"):
        spec = eng.generate(prompt_ids=ids, params=SamplingParams(max_tokens=60, speculative=mode))
        assert spec.ids == plain.ids, mode
        assert spec.accepted_tokens < spec.draft_tokens  # there were rollbacks
    assert len(ids) + len(plain.ids) > slots


def test_prefix_reuse_after_a_longer_sequence_on_rings(gemma3_path):
    """A sequence that reuses a prefix and ends sooner leaves the longer one's later positions in the
    rings: a third sequence must not reuse a prefix whose keys those overwrote."""
    eng = Engine(str(gemma3_path), threads=2, kv_budget="64MiB")
    fresh = Engine(str(gemma3_path), threads=2, kv_budget="64MiB")
    slots = min(k.shape[0] for k in eng.model.kv.k)
    text = _text_ids(eng.model, slots + 400)
    a = text[:slots + 360]
    b = text[:slots + 260] + text[10:20]
    c = text[:slots + 160] + text[30:40]
    params = SamplingParams(max_tokens=8)
    eng.generate(prompt_ids=a, params=params)
    assert eng.generate(prompt_ids=b, params=params).prefix_hit_tokens == slots + 260
    got = eng.generate(prompt_ids=c, params=params)
    assert got.ids == fresh.generate(prompt_ids=c, params=params).ids


# --------------------------------------------------------------------------- configuration errors

def test_a_draft_model_with_another_vocabulary_is_refused(smollm2_path, gemma3_path):
    with pytest.raises(EngineError, match="draft model.*tokenizer.ggml.model"):
        Engine(str(smollm2_path), threads=1, kv_budget="8MiB", draft=str(gemma3_path))


def test_draft_mode_needs_a_draft_model(smollm2_path):
    with pytest.raises(EngineError, match="needs a draft model"):
        Engine(str(smollm2_path), threads=1, kv_budget="8MiB", speculative="draft")
    eng = Engine(str(smollm2_path), threads=1, kv_budget="8MiB")
    with pytest.raises(EngineError, match="no draft model"):
        eng.generate(prompt="Hi", params=SamplingParams(max_tokens=2, speculative="draft"))


def test_pass_costs_are_timed_over_the_first_speculative_requests(smollm2_path):
    from engine.speculative import DEFAULT_PASS_COSTS, PassTimer

    eng = Engine(str(smollm2_path), threads=2, kv_budget="16MiB", speculative="prompt_lookup")
    prompt = "Count: 1, 2, 3, 4, 5,"
    plain = eng.generate(prompt=prompt, params=SamplingParams(max_tokens=24, speculative="off"))
    assert eng.pass_costs == list(DEFAULT_PASS_COSTS)  # nothing timed by a plain request
    for i in range(PassTimer.REPEATS + 1):
        spec = eng.generate(prompt=prompt, params=SamplingParams(max_tokens=24))  # the engine's default mode
        assert spec.ids == plain.ids  # the passes timed past the prompt changed nothing
        costs = eng.pass_costs
        assert len(costs) == MAX_DRAFT + 2 and costs[1] == 1.0 and costs != list(DEFAULT_PASS_COSTS)
        assert all(a <= b for a, b in zip(costs[1:], costs[2:])), costs  # a longer pass never costs less
    assert eng._timer.done and len(eng._timer.ratios[2]) == PassTimer.REPEATS  # then no more timing

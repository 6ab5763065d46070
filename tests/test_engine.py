"""Engine.generate: greedy output against llama.cpp, sampling, stop strings, streaming, the KV
budget, prefix reuse, and bad input."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine, EngineError, EngineInterrupted
from engine.params import SamplingParams
from engine.sampler import Sampler, apply_repetition_penalty

FIXTURES = Path(__file__).parent / "fixtures"
_ENGINES: dict[str, Engine] = {}


def engine_for(path) -> Engine:
    key = str(path)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(key, threads=2, kv_budget="64MiB")
    return _ENGINES[key]


@pytest.fixture
def smollm2(smollm2_path) -> Engine:
    return engine_for(smollm2_path)


NEAR_TIE = 0.5  # logit gap under which llama.cpp disagrees with itself (batched vs one at a time)


@pytest.mark.parametrize("name,fixture", [("smollm2-135m", "smollm2_path"), ("gemma3-270m", "gemma3_path")])
def test_greedy_follows_llamacpp(name, fixture, request):
    """Our greedy engine against llama.cpp's greedy runs on 8 varied prompts.

    Each step is fed llama.cpp's own previous tokens (teacher forcing), so one near-tie does not
    decide the remaining 31 tokens. We must pick llama.cpp's token at every step where llama.cpp
    was decided (best logit ahead by >= NEAR_TIE) and at >= 90 % of all steps. (Free-running
    32-token runs diverge after the first near-tie; llama.cpp itself does not reproduce them
    across batch sizes, so they are counted in the benchmark notes, not asserted here.)
    """
    fix_path = FIXTURES / f"llamacpp_greedy_{name}.json"
    if not fix_path.exists():
        pytest.skip(f"{fix_path.name} missing")
    eng = engine_for(request.getfixturevalue(fixture))
    cases = json.loads(fix_path.read_text())["cases"]
    assert len(cases) == 8
    steps = agree = 0
    decided_misses = []
    for case in cases:
        # Same prompt ids as llama.cpp computed them (the tokenizer is tested on its own).
        assert eng.prompt_ids(case["prompt"]) == case["prompt_ids"], case["name"]
        theirs = case["greedy_ids"]
        seq = case["prompt_ids"] + theirs
        ours = eng.model.forward_all(seq[:-1]).argmax(-1)[len(case["prompt_ids"]) - 1:]
        for i, (a, b) in enumerate(zip(ours, theirs)):
            steps += 1
            agree += int(a == b)
            if a != b and case["margins"][i] >= NEAR_TIE:
                decided_misses.append((case["name"], i, case["margins"][i]))
    print(f"{name}: {agree}/{steps} steps agree with llama.cpp")
    assert not decided_misses, f"differs where llama.cpp was decided: {decided_misses}"
    assert agree / steps >= 0.9, f"{agree}/{steps} steps agree"


def test_stream_pieces_concatenate_to_the_text(smollm2):
    pieces: list[str] = []
    gen = smollm2.generate(prompt="Write a haiku about snow:", params=SamplingParams(max_tokens=24),
                           on_text=pieces.append)
    assert gen.completion_tokens == len(gen.ids) > 0
    assert "".join(pieces) == gen.text == smollm2.tokenizer.decode(gen.ids)


def test_stop_string_ends_generation_and_is_not_emitted(smollm2):
    free = smollm2.generate(prompt="Count: 1, 2, 3,", params=SamplingParams(max_tokens=20))
    assert " 5" in free.text, free.text  # the premise: greedy output counts on past 5
    pieces: list[str] = []
    gen = smollm2.generate(prompt="Count: 1, 2, 3,", params=SamplingParams(max_tokens=20, stop=[" 5"]),
                           on_text=pieces.append)
    assert gen.finish_reason == "stop"
    assert " 5" not in gen.text
    assert free.text.startswith(gen.text)
    assert "".join(pieces) == gen.text


def test_same_seed_same_tokens(smollm2):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    a = smollm2.generate(prompt="The weather today", params=params)
    b = smollm2.generate(prompt="The weather today", params=params)
    assert a.ids == b.ids
    others = {tuple(smollm2.generate(prompt="The weather today",
                                     params=params.model_copy(update={"seed": s})).ids) for s in range(4)}
    assert len(others) > 1, "different seeds should not all give the same text"


def test_prefix_reuse_gives_identical_output(smollm2, smollm2_path):
    shared = "Summarise the following text in one sentence.\n\nText: "
    smollm2.generate(prompt=shared + "Cats sleep a lot.", params=SamplingParams(max_tokens=4))
    reused = smollm2.generate(prompt=shared + "Dogs like to run in parks.", params=SamplingParams(max_tokens=12))
    assert reused.prefix_hit_tokens >= 10
    fresh_engine = Engine(str(smollm2_path), threads=2, kv_budget="64MiB")
    fresh = fresh_engine.generate(prompt=shared + "Dogs like to run in parks.", params=SamplingParams(max_tokens=12))
    assert fresh.prefix_hit_tokens == 0
    # Same continuation start; (bit-exactness across pass splits is tested on the scalar path in
    # test_forward.py; SIMD sums differ in order, which can flip a near-tie later on).
    assert reused.ids[:3] == fresh.ids[:3]
    ids = reused.prompt_ids
    a = smollm2.model.forward(ids[-1:], len(ids) - 1).copy()  # cache holds the prefix now
    b = fresh_engine.model.forward(ids, 0)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.05


def test_request_over_the_kv_budget_is_refused_naming_both_numbers(smollm2_path):
    eng = Engine(str(smollm2_path), threads=1, kv_budget="2MiB")
    cap = eng.kv_capacity
    prompt = "word " * (cap // 2)
    n = len(eng.prompt_ids(prompt))
    with pytest.raises(EngineError) as err:
        eng.generate(prompt=prompt, params=SamplingParams(max_tokens=cap))
    msg = str(err.value)
    assert f"{n} tokens" in msg and f"max_tokens ({cap})" in msg and f"capacity of {cap} tokens" in msg


@pytest.mark.parametrize("kwargs,needle", [
    ({"prompt": ""}, "empty"),
    ({"prompt": "   \n"}, "empty"),
    ({"messages": []}, "empty"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
    ({"prompt": "bad \udcff surrogate"}, "UTF-8"),
])
def test_bad_requests_are_refused(smollm2, kwargs, needle):
    with pytest.raises(EngineError, match=needle):
        smollm2.generate(params=SamplingParams(max_tokens=4), **kwargs)


def test_should_stop_interrupts(smollm2):
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 3

    # Greedy output of this prompt counts on for 20 tokens (see the stop-string test).
    with pytest.raises(EngineInterrupted):
        smollm2.generate(prompt="Count: 1, 2, 3,", params=SamplingParams(max_tokens=20), should_stop=stop)
    assert len(calls) == 4
    # The engine is still usable and consistent afterwards.
    assert smollm2.generate(prompt="Hello", params=SamplingParams(max_tokens=3)).completion_tokens > 0


def test_chat_generation_ends_at_end_of_turn(smollm2):
    gen = smollm2.generate(messages=[{"role": "user", "content": "Say hello."}], params=SamplingParams(max_tokens=64))
    assert gen.finish_reason == "stop"
    assert "<|im_end|>" not in gen.text and gen.text.strip()


# --------------------------------------------------------------------------- bad model files

def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_bad_gguf_files_give_clear_errors(tmp_path, smollm2_path):
    real = Path(smollm2_path).read_bytes()[:1 << 20]
    cases = {
        "truncated.gguf": (real[:100], "truncat|end of file|short"),
        "magic.gguf": (b"NOPE" + real[4:], "magic"),
        "empty.gguf": (b"", "short|truncat|empty|header"),
    }
    for name, (data, pattern) in cases.items():
        with pytest.raises(EngineError, match=f"(?i){pattern}"):
            Engine(_write(tmp_path / name, data))


def _tiny_gguf(path: Path, arch: str) -> Path:
    """A valid GGUF holding one small F32 tensor, written by the gguf package."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_tensor_type_is_named(tmp_path):
    path = _tiny_gguf(tmp_path / "weird.gguf", "llama")
    data = bytearray(path.read_bytes())
    # Patch the tensor's type id (after its name, n_dims and dims) to an unassigned one.
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    struct.pack_into("<I", data, at, 200)
    path.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="200"):
        Engine(str(path))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    path = _tiny_gguf(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(EngineError, match="mamba.*llama.*gemma3"):
        Engine(str(path))


# --------------------------------------------------------------------------- sampler

def test_sampler_limits_reduce_to_greedy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(5000).astype(np.float32) * 3
    best = int(np.argmax(logits))
    for params in (SamplingParams(temperature=1.0, top_k=1, seed=1),
                   SamplingParams(temperature=1.0, top_p=1e-6, seed=2),
                   SamplingParams(temperature=1.0, min_p=1.0, seed=3)):
        assert all(Sampler(params).sample(logits, []) == best for _ in range(20))


def test_sampler_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    counts = np.bincount([s.sample(logits, []) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.03)
    top_p = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=7))
    assert {top_p.sample(logits, []) for _ in range(300)} == {0, 1}


def test_repetition_penalty_formula():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])
    assert logits[0] == 2.0  # the caller's array is untouched

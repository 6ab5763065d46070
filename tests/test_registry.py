"""The model registry (engine/registry.py): every model fetched from PyPI is pinned (each package to
one version, the assembled file to a sha256), and the models `models pull` knows are what they say."""
from __future__ import annotations

import re

import pytest

from engine.registry import KNOWN_MODELS, KnownModel, is_cached

PACKAGED = [m for m in KNOWN_MODELS.values() if m.packages]
PINNED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][A-Za-z0-9.+!-]*$")  # name==version, nothing looser


@pytest.mark.parametrize("model", PACKAGED, ids=lambda m: m.name)
def test_packaged_models_pin_every_version_and_a_checksum(model: KnownModel):
    loose = [spec for spec in model.packages if not PINNED.match(spec)]
    assert not loose, f"{model.name}: pin each package to one version (name==version): {loose}"
    assert len({spec.split("==")[0].lower() for spec in model.packages}) == len(model.packages)
    # the file is checked after assembly: a package republished under the same version, or parts
    # concatenated in the wrong order, must fail the pull rather than load
    assert model.sha256 is not None and re.fullmatch(r"[0-9a-f]{64}", model.sha256), model.name
    assert model.members and len(set(model.members)) == len(model.members), model.name
    assert model.filename.endswith(".gguf")


def test_member_suffixes_do_not_match_another_member():
    """pull() takes the first wheel member ending with each suffix: none may end with another's."""
    for model in PACKAGED:
        for a in model.members:
            for b in model.members:
                assert a == b or not b.endswith(a), (model.name, a, b)


QWEN_05B = "qwen2.5-coder-0.5b-instruct"


# Only when already in the cache: a run must not download 469 MiB for this one test.
# (tests/model_available.needs_model would not skip: resolve(name, auto_pull=False) returns a known
# model's cache path whether or not the file is there, so the engine would pull it.)
NEAR_TIE = 0.5  # logits: below this margin llama.cpp's own batch-vs-single-token noise can flip a token


@pytest.mark.skipif(not is_cached(QWEN_05B), reason=f"{QWEN_05B} is not in the cache (rqllm models pull {QWEN_05B})")
def test_qwen_coder_0_5b_can_chat_and_continues_as_llama_cpp_does():
    """Greedy raw continuations, 32 tokens, against llama.cpp's llama-simple on the same file (measured
    once; the notes in README's Models section): ours is llama.cpp's text, or follows it up to
    a near-tie, a step where the token llama.cpp took is within NEAR_TIE of our top one (the criterion
    of tests/test_reference.py: below it, llama.cpp's own batch-vs-single-token noise flips tokens)."""
    import numpy as np

    from engine.engine import Engine
    from engine.params import SamplingParams

    eng = Engine(QWEN_05B, threads=2, kv_budget="16MiB")
    assert eng.model.cfg.arch == "qwen2" and eng.chat_capability.has_template
    llama_cpp = {
        "The capital of France is": " Paris. Paris is located in the northwestern part of France. The capital of "
                                    "France is located in the northwestern part of France. Paris is located in the",
        "def fibonacci(n):": '\n    if n <= 0:\n        return "Invalid input"\n    elif n == 1:\n'
                             '        return 0\n    elif n == 2',
    }
    decode = eng.tokenizer.decode
    for prompt, expected in llama_cpp.items():
        gen = eng.generate(prompt, params=SamplingParams(max_tokens=32))
        assert gen.completion_tokens == 32, prompt
        if gen.text == expected:
            continue
        step = next(i for i in range(32) if not expected.startswith(decode(gen.ids[:i + 1])))
        logits = np.asarray(eng.model.forward_all(gen.prompt_ids + gen.ids[:step]))[-1]
        done = decode(gen.ids[:step])
        # llama.cpp's token at this step: among our 5 best, the one that continues its text furthest
        cands = [int(t) for t in np.argsort(logits)[::-1][:5]]
        theirs = max(cands, key=lambda t: len(decode(gen.ids[:step] + [t])) if expected.startswith(
            decode(gen.ids[:step] + [t])) and len(decode(gen.ids[:step] + [t])) > len(done) else -1)
        follows = expected.startswith(decode(gen.ids[:step] + [theirs]))
        gap = float(logits.max() - logits[theirs])
        assert follows and gap < NEAR_TIE, (prompt, step, gen.text, decode([theirs]), gap)

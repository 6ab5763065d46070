"""Decoding that does not loop: frequency and presence penalties (OpenAI's formula, over the
generated tokens), the no-repeat n-gram guard, and the sentence-complete stop at max_tokens -
their arithmetic here, and on the real model at the end (speculative decoding's exactness with them
is in test_speculative.py)."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from engine.params import SamplingParams
from engine.sampler import (
    Sampler,
    apply_frequency_presence_penalties,
    repeated_ngram_completions,
)
from engine.sentences import complete_end, sentence_ends, trim_to_complete
from tests.model_available import needs_model

# --------------------------------------------------------------------------- penalties


def test_frequency_and_presence_penalties_follow_openais_formula():
    logits = np.array([1.0, 2.0, 3.0, -1.0], dtype=np.float32)
    out = apply_frequency_presence_penalties(logits, [1, 1, 1, 3], frequency=0.5, presence=0.25)
    # token 1: 3 times -> 2 - 3 * 0.5 - 0.25; token 3: once -> -1 - 0.5 - 0.25; others untouched
    np.testing.assert_allclose(out, [1.0, 0.25, 3.0, -1.75])
    assert logits[1] == 2.0  # the caller's array is untouched


def test_penalties_count_generated_tokens_only_and_extra_counts_as_generated():
    logits = np.zeros(6, dtype=np.float32)
    sampler = Sampler(SamplingParams(frequency_penalty=1.0), prompt_len=3)
    out = sampler.penalized(logits, [4, 4, 4, 2], extra=[2, 5])
    # the prompt's three 4s count for nothing; 2 was generated once and guessed once
    np.testing.assert_allclose(out, [0, 0, -2, 0, 0, -1])


def test_negative_penalties_favour_repeats():
    out = apply_frequency_presence_penalties(np.zeros(3, dtype=np.float32), [2], frequency=-1.0, presence=-0.5)
    assert int(np.argmax(out)) == 2


def test_repetition_penalty_still_looks_at_the_prompt():
    """llama.cpp's repeat penalty counts the prompt's last tokens (llama-server feeds them in)."""
    logits = np.array([4.0, 3.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(repetition_penalty=2.0), prompt_len=1)
    assert sampler.sample(logits, [0]) == 1  # 4 / 2 < 3: the prompt's token 0 was penalised


@pytest.mark.parametrize("field,value", [("frequency_penalty", 2.5), ("presence_penalty", -3),
                                         ("no_repeat_ngram_size", -1), ("no_repeat_ngram_size", 65)])
def test_out_of_range_knobs_are_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


# --------------------------------------------------------------------------- no-repeat n-gram guard


def test_guard_bans_the_token_that_would_repeat_an_ngram():
    # "a b c a b" + c would repeat the 3-gram "a b c"
    assert repeated_ngram_completions([1, 2, 3, 1, 2], 3).tolist() == [3]
    # two earlier continuations of "a b": both banned
    assert repeated_ngram_completions([1, 2, 3, 1, 2, 4, 1, 2], 3).tolist() == [3, 4]
    assert repeated_ngram_completions([1, 2, 3, 4], 3).tolist() == []  # "3 4" never seen before
    assert repeated_ngram_completions([1, 2], 3).tolist() == []  # shorter than an n-gram
    assert repeated_ngram_completions([5, 7, 5], 1).tolist() == [5, 7]  # n = 1: no token twice
    # n = 2 with a repeated token: "7 7" exists, so after 7 another 7 is banned
    assert repeated_ngram_completions([7, 7], 2).tolist() == [7]


def test_guard_makes_greedy_leave_a_loop():
    logits = np.array([0.0, 5.0, 4.0, 1.0], dtype=np.float32)  # token 1 best, 2 next
    plain = Sampler(SamplingParams())
    guarded = Sampler(SamplingParams(no_repeat_ngram_size=2), prompt_len=2)
    context = [1, 1, 3, 1]  # prompt "1 1", generated "3 1" - the guard must not see the prompt's "1 1"
    assert plain.sample(logits, context) == 1
    assert guarded.sample(logits, context) == 1  # "1 1" is only in the prompt: allowed
    assert guarded.sample(logits, context, extra=[1]) == 2  # generated "3 1 1" has "1 1": no third 1
    # sampling never draws a banned token
    hot = Sampler(SamplingParams(no_repeat_ngram_size=2, temperature=5.0, seed=3), prompt_len=0)
    draws = {hot.sample(logits, [1, 2, 1]) for _ in range(300)}
    assert 2 not in draws and draws <= {0, 1, 3}
    ids, probs = hot.distribution(logits, [1, 2, 1])
    assert probs[ids == 2].sum() == 0.0


def test_guard_off_changes_nothing():
    logits = np.random.default_rng(1).standard_normal(50).astype(np.float32)
    sampler = Sampler(SamplingParams())
    assert sampler.penalized(logits, list(range(40)) * 3) is logits


# --------------------------------------------------------------------------- sentence ends


@pytest.mark.parametrize("text,complete", [
    ("Hello world. This is", "Hello world."),
    ("See e.g. the manual. Then", "See e.g. the manual."),  # an abbreviation is no end
    ("J. Smith went home! And", "J. Smith went home!"),  # nor an initial
    ("Steps:\n1. Install it\n2. Run", "Steps:\n1. Install it"),  # nor a list number; a line is complete
    ("東京は大きい。人が多い。まだ", "東京は大きい。人が多い。"),  # CJK full stops, no spaces
    ("他说：「好！」然后", "他说：「好！」"),  # closing brackets stay with the sentence
    ('He said "stop." Then', 'He said "stop."'),
    ("The value 3.5 is", "The value 3.5 is"),  # no end at all: kept whole
    ("- one\n- two\n- thr", "- one\n- two"),
    ("Done.", "Done."),
    ("Run it.\n```python\nimport x\nx.run()\ny = ", "Run it."),  # not inside a code block that never closes
    ("Run it.\n```\nx.run()\n```\nThen it wor", "Run it.\n```\nx.run()\n```"),
])
def test_trim_to_complete(text, complete):
    assert trim_to_complete(text) == complete


def test_sentence_ends_offsets():
    text = "One. Two! Three? Four… 五。"
    assert [text[:e][-1] for e in sentence_ends(text)] == [".", "!", "?", "…", "。"]
    assert complete_end("no end") == 0


# --------------------------------------------------------------------------- on the real model


@needs_model("smollm2-135m")
class TestOnTheModel:
    @pytest.fixture(scope="class")
    def eng(self):
        from engine.engine import Engine

        return Engine("smollm2-135m", threads=2, kv_budget="32MiB")

    LOOPY = {"messages": [{"role": "user", "content": "Write the word 'banana' and the sentence 'I like fruit.' "
                                                      "again and again."}]}

    def _repeated_4grams(self, ids: list[int]) -> int:
        grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
        return len(grams) - len(set(grams))

    @pytest.fixture(scope="class")
    def plain(self, eng):
        return eng.generate(**self.LOOPY, params=SamplingParams(max_tokens=60))

    def test_guard_removes_repeats_that_plain_greedy_makes(self, eng, plain):
        guarded = eng.generate(**self.LOOPY, params=SamplingParams(max_tokens=60, no_repeat_ngram_size=4))
        assert self._repeated_4grams(plain.ids) > 0, plain.text  # the premise: plain greedy loops
        assert self._repeated_4grams(guarded.ids) == 0, guarded.text

    def test_penalties_reduce_repeats(self, eng, plain):
        penalised = eng.generate(**self.LOOPY, params=SamplingParams(max_tokens=60, frequency_penalty=1.5,
                                                                    presence_penalty=0.5))
        assert self._repeated_4grams(penalised.ids) < self._repeated_4grams(plain.ids), penalised.text

    def test_a_text_cut_by_max_tokens_ends_at_a_complete_sentence(self, eng):
        kwargs = {"messages": [{"role": "user", "content": "Explain how a refrigerator works."}]}
        for max_tokens in (23, 37, 51):
            cut = eng.generate(**kwargs, params=SamplingParams(max_tokens=max_tokens))
            pieces: list[str] = []
            kept = eng.generate(**kwargs, params=SamplingParams(max_tokens=max_tokens, end_at_sentence=True),
                                on_text=pieces.append)
            assert cut.finish_reason == kept.finish_reason == "length"
            assert kept.ids == cut.ids  # the same tokens; only the text ends sooner
            assert cut.text.startswith(kept.text) and len(kept.text) < len(cut.text), (cut.text, kept.text)
            assert kept.text.rstrip()[-1] in ".!?:" or cut.text[len(kept.text)] == "\n", kept.text
            assert "".join(pieces) == kept.text  # nothing streamed that the text then lost

    def test_a_text_that_ends_by_itself_is_not_trimmed(self, eng):
        kwargs = {"messages": [{"role": "user", "content": "Say hello."}]}
        plain = eng.generate(**kwargs, params=SamplingParams(max_tokens=64))
        kept = eng.generate(**kwargs, params=SamplingParams(max_tokens=64, end_at_sentence=True))
        assert plain.finish_reason == "stop" and kept.text == plain.text


class _CharTokenizer:
    """Token i = the i-th character of a fixed text: streams any cut of it."""

    def __init__(self, text: str):
        self.text = text

    def stream_decoder(self):
        text = self.text

        class Decoder:
            def push(self, token: int) -> str:
                return text[token]

            def flush(self) -> str:
                return ""

        return Decoder()


@pytest.mark.parametrize("text", [
    "The value is 3.5 today. Then the next one is cut",
    "Dr. Who met J. Smith. Then",
    "- one\n- two\n- thr",
    "Intro done.\n```python\nimport x\nx.run()\n",
    "Intro done.\n```\nx.run()\n```\nAfter it. More",
    "東京は大きい。人が多い。ま",
    'He said "stop." She went',
])
def test_streamed_text_never_runs_past_the_final_sentence_cut(text):
    from engine.engine import _TextStream

    for cut in range(1, len(text) + 1):
        pieces: list[str] = []
        stream = _TextStream(_CharTokenizer(text), [], pieces.append, end_at_sentence=True)
        for i in range(cut):
            stream.push(i)
            assert text[:cut].startswith("".join(pieces))
        final = stream.finish(length_cut=True)
        assert "".join(pieces) == final == trim_to_complete(text[:cut]), (cut, pieces)

"""Constrained decoding (engine.constraint) with real models: outputs under a response_format parse and
validate (jsonschema, an independent validator) or end with finish_reason "length"; greedy and sampled,
with and without prompt-lookup speculation; speculation changes no greedy token; formats that do not
compile are refused when the request is built."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from pydantic import ValidationError

from engine.engine import Engine
from engine.params import SamplingParams
from engine.speculative import MAX_DRAFT
from tests.model_available import needs_model, why_model_missing
from tests.structured_cases import SCHEMAS, check_output, messages, response_format

pytestmark = needs_model("smollm2-135m")
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def eng(smollm2_path) -> Engine:
    e = Engine(str(smollm2_path), threads=2, kv_budget="32MiB")
    # Every pass priced as one token's: prompt lookup guesses whenever it finds text to copy. Timed costs
    # depend on the host's load, and on a busy one they can make no guess worth checking (CI saw that).
    e.set_speculation_costs([0.0] + [1.0] * (MAX_DRAFT + 1))
    return e


@pytest.mark.parametrize("speculative", ["off", "prompt_lookup"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_schema_gives_valid_json(eng: Engine, temperature: float, speculative: str):
    complete = 0
    for name, schema in SCHEMAS.items():
        params = SamplingParams(max_tokens=120, temperature=temperature, seed=11, speculative=speculative,
                                response_format=response_format(name))
        gen = eng.generate(messages=messages(name), params=params)
        complete += check_output(gen.text, gen.finish_reason, schema)
    assert complete >= len(SCHEMAS) - 1  # the bounds leave the model room to finish nearly always


def test_prompt_lookup_changes_no_greedy_token_under_a_schema(eng: Engine):
    """The matcher rolls back with rejected guesses: speculative greedy == plain greedy, token for token."""
    for name in ("nested", "pattern", "array"):
        fmt = response_format(name)
        plain = eng.generate(messages=messages(name), params=SamplingParams(max_tokens=80, response_format=fmt))
        spec = eng.generate(messages=messages(name), params=SamplingParams(max_tokens=80, response_format=fmt,
                                                                           speculative="prompt_lookup"))
        assert spec.ids == plain.ids
        assert spec.draft_tokens > 0


def test_sampled_outputs_differ_by_seed_and_stay_valid(eng: Engine):
    schema = SCHEMAS["optional_fields"]
    texts = set()
    for seed in range(4):
        gen = eng.generate(messages=messages("optional_fields"),
                           params=SamplingParams(max_tokens=80, temperature=1.2, seed=seed,
                                                 response_format=response_format("optional_fields")))
        check_output(gen.text, gen.finish_reason, schema)
        texts.add(gen.text)
    assert len(texts) > 1  # sampling really samples under the mask


def test_json_cut_by_max_tokens_is_length(eng: Engine):
    gen = eng.generate(messages=messages("nested"), params=SamplingParams(max_tokens=5,
                                                                          response_format=response_format("nested")))
    assert gen.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(gen.text)
    assert gen.text.startswith("{")


def test_regex_and_json_object(eng: Engine):
    gen = eng.generate(prompt="Order number:", params=SamplingParams(
        max_tokens=20, response_format={"type": "regex", "regex": "[A-Z]{2}[0-9]{4}"}))
    assert gen.finish_reason == "stop" and re.fullmatch("[A-Z]{2}[0-9]{4}", gen.text), gen.text
    gen = eng.generate(messages=[{"role": "user", "content": "A JSON object describing a cat."}],
                       params=SamplingParams(max_tokens=100, response_format={"type": "json_object"}))
    if gen.finish_reason == "stop":
        assert isinstance(json.loads(gen.text), dict)
    else:
        assert gen.text.startswith("{")


def test_logprobs_and_stop_strings_with_a_schema(eng: Engine):
    params = SamplingParams(max_tokens=60, logprobs=2, response_format=response_format("enum"))
    gen = eng.generate(messages=messages("enum"), params=params)
    assert gen.logprobs is not None and len(gen.logprobs) == len(gen.ids)
    assert "".join(e.token for e in gen.logprobs) == gen.text


@pytest.mark.parametrize("speculative", ["off", "prompt_lookup"])
def test_stop_strings_do_not_cut_a_constrained_value(eng: Engine, speculative: str):
    """Stop strings that occur inside the JSON (a key, a quote, the separator) are part of the value: the
    output still validates and ends with "stop", the same tokens as without stop strings."""
    fmt = response_format("enum")
    plain = eng.generate(messages=messages("enum"), params=SamplingParams(max_tokens=60, response_format=fmt))
    assert plain.finish_reason == "stop" and '"severity"' in plain.text
    stopped = eng.generate(messages=messages("enum"), params=SamplingParams(
        max_tokens=60, response_format=fmt, speculative=speculative, stop=['"severity"', '"', ", "]))
    assert check_output(stopped.text, stopped.finish_reason, SCHEMAS["enum"])
    assert stopped.ids == plain.ids and stopped.text == plain.text


def test_a_stop_string_after_a_complete_value_ends_the_text(eng: Engine):
    """A regex whose value is complete after "AB12" but may go on: a stop string right there cuts it."""
    fmt = {"type": "regex", "regex": "[A-Z]{2}[0-9]{2}( [a-z]+)*"}
    prompt = "Code and words: AB12 cat dog. Code and words:"
    free = eng.generate(prompt=prompt, params=SamplingParams(max_tokens=12, response_format=fmt))
    assert re.match("[A-Z]{2}[0-9]{2}( [a-z]+)+", free.text), free.text  # it goes on past the code
    code, first_word = free.text.split(" ")[:2]
    stopped = eng.generate(prompt=prompt, params=SamplingParams(max_tokens=12, response_format=fmt, stop=[" "]))
    assert stopped.finish_reason == "stop" and stopped.text == code
    # a stop string starting inside the value (after "AB1") is part of it
    inside = eng.generate(prompt=prompt, params=SamplingParams(max_tokens=12, response_format=fmt,
                                                                stop=[code[3:] + " " + first_word]))
    assert inside.text.startswith(code + " " + first_word), inside.text


def test_ll_tokenizer_is_built_once_per_tokenizer(eng: Engine):
    from engine.constraint import ll_tokenizer

    n = eng.model.cfg.n_vocab
    assert ll_tokenizer(eng.tokenizer, n) is ll_tokenizer(eng.tokenizer, n)
    assert ll_tokenizer(eng.tokenizer, n).vocab_size == n


def test_constraint_rolls_back_to_the_same_mask(eng: Engine):
    from engine.constraint import Constraint, grammar_for
    from engine.params import ResponseFormat

    fmt = ResponseFormat.model_validate(response_format("enum"))
    c = Constraint(eng.tokenizer, grammar_for(fmt), eng.model.cfg.n_vocab)
    start = c.allowed().copy()
    prefix = eng.tokenizer.encode('{"product": "Acme", "severity": "', add_bos=False)
    assert c.valid_prefix([], prefix) == len(prefix)
    c.sync(prefix)
    after = c.allowed().copy()
    pieces = [eng.tokenizer.token_bytes(int(t)) for t in after.nonzero()[0]]
    assert pieces and all(any(v.startswith(p) for v in (b'low"}', b'medium"}', b'high"}')) for p in pieces), pieces
    first = [eng.tokenizer.token_bytes(int(t)) for t in start.nonzero()[0]]
    assert first and all(p.startswith(b"{") for p in first), first  # an object, no leading whitespace
    c.sync([])  # all rolled back
    assert (c.allowed() == start).all()
    c.sync(prefix)
    assert (c.allowed() == after).all()
    bad = eng.tokenizer.encode('{"colour"', add_bos=False)
    assert c.valid_prefix([], bad) < len(bad)


def test_masked_logits_match_llguidance_numpy_helpers(eng: Engine):
    """Constraint.apply (which reuses its output array and picks a path by how many tokens are allowed)
    against llguidance's own numpy helpers on a second matcher, at every state of a generation with
    few-token states (keys, punctuation) and most-token ones (inside strings), EOS included at the end."""
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

    from engine.constraint import Constraint, grammar_for, ll_tokenizer
    from engine.params import ResponseFormat

    n_vocab = eng.model.cfg.n_vocab
    fmt = ResponseFormat.model_validate(response_format("nested"))
    ids = eng.generate(messages=messages("nested"), params=SamplingParams(max_tokens=80, response_format=fmt)).ids
    c = Constraint(eng.tokenizer, grammar_for(fmt), n_vocab)
    reference = LLMatcher(ll_tokenizer(eng.tokenizer, n_vocab), grammar_for(fmt))
    bitmask = allocate_token_bitmask(1, n_vocab)
    rng = np.random.default_rng(5)
    sizes = []
    for i in range(len(ids) + 1):
        logits = rng.standard_normal(n_vocab).astype(np.float32)
        expected = logits.copy()[None, :]
        fill_next_token_bitmask(reference, bitmask)
        apply_token_bitmask_inplace(expected, bitmask)
        got = c.apply(logits, ids[:i])
        assert np.array_equal(got, expected[0]), i
        sizes.append(int(np.isfinite(got).sum()))
        if i < len(ids):
            assert reference.consume_token(ids[i])
    assert min(sizes) <= 3 and max(sizes) > n_vocab // 2  # both kinds of state were met
    for back_to in (3, 0):  # rolled back (a rejected guess), from a most-allowed state to few
        reference.rollback(len(ids) - back_to) if back_to else reference.reset()
        fill_next_token_bitmask(reference, bitmask)
        expected = logits.copy()[None, :]
        apply_token_bitmask_inplace(expected, bitmask)
        assert np.array_equal(c.apply(logits, ids[:back_to]), expected[0])
        c.apply(logits, ids)  # forward again
        reference.consume_tokens(ids[back_to:])


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "Invalid type: strng"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/defs/none"}}}, "does not exist"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 5,
                                                                     "maxLength": 2}}}, "Unsatisfiable"),
    ({"type": "regex", "regex": "(("}, "unclosed group"),
    ({"type": "json_schema"}, "json_schema is needed"),
    ({"type": "xml"}, "Input should be"),
])
def test_formats_that_do_not_compile_are_refused_when_built(fmt: dict, words: str):
    with pytest.raises(ValidationError) as err:
        SamplingParams(response_format=fmt)
    assert words in str(err.value)


def test_text_format_is_no_format():
    assert SamplingParams(response_format={"type": "text"}).response_format is None


@pytest.mark.skipif(why_model_missing(DEFAULT_MODEL) is not None, reason=why_model_missing(DEFAULT_MODEL) or "")
def test_default_model_every_schema():
    eng = Engine(DEFAULT_MODEL, threads=2, kv_budget="64MiB")
    complete = 0
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        params = SamplingParams(max_tokens=100, temperature=0.0 if i % 2 else 0.8, seed=5,
                                speculative="prompt_lookup" if i % 3 else "off",
                                response_format=response_format(name))
        gen = eng.generate(messages=messages(name), params=params)
        complete += check_output(gen.text, gen.finish_reason, schema)
    assert complete >= len(SCHEMAS) - 1


def test_draft_model_guesses_follow_the_grammar(smollm2_path):
    """A draft model (here the model itself) samples its guesses under the same constraint; greedy output
    is plain greedy's and nearly every guess is kept."""
    eng = Engine(str(smollm2_path), threads=2, kv_budget="32MiB", draft=str(smollm2_path))
    # fixed costs that make guessing pay: timed ones (a draft as costly as the model) would not draft at all
    eng.set_speculation_costs([0.0] + [1.0] * (MAX_DRAFT + 1), draft_step=0.05)
    fmt = response_format("bounded_numbers")
    plain = eng.generate(messages=messages("bounded_numbers"),
                         params=SamplingParams(max_tokens=60, response_format=fmt))
    drafted = eng.generate(messages=messages("bounded_numbers"),
                           params=SamplingParams(max_tokens=60, response_format=fmt, speculative="draft"))
    assert drafted.ids == plain.ids and drafted.draft_tokens > 0
    assert drafted.accepted_tokens >= 0.9 * drafted.draft_tokens
    check_output(drafted.text, drafted.finish_reason, SCHEMAS["bounded_numbers"])


def test_the_grammar_outranks_the_no_repeat_guard(eng: Engine):
    """no_repeat_ngram_size=1 bans every token once generated ('"' and ', ' among them): where it bans all
    the grammar allows, the grammar's tokens stay choosable and the output is still valid."""
    for temperature in (0.0, 0.8):
        gen = eng.generate(messages=messages("nested"), params=SamplingParams(
            max_tokens=100, temperature=temperature, seed=1, no_repeat_ngram_size=1,
            response_format=response_format("nested")))
        assert check_output(gen.text, gen.finish_reason, SCHEMAS["nested"]), gen.text


@pytest.mark.parametrize("command", [["generate", "smollm2-135m", "Hi"],
                                     ["submit", "Hi", "--wait", "-m", "smollm2-135m"]])
def test_cli_refuses_a_bad_schema_before_any_work(tmp_path, command):
    import subprocess
    import sys
    from pathlib import Path

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "intger"}}}))
    p = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", *command, "--json-schema",
                        str(bad)], cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and "Invalid type: intger" in p.stderr, p.stderr


def test_an_spm_tokenizer_works_too(gemma3_path):
    """Gemma 3 (SentencePiece, a 262k vocabulary with byte tokens): the masks come from its token bytes too."""
    gemma = Engine(str(gemma3_path), threads=2, kv_budget="32MiB")
    complete = 0
    for name in ("nested", "enum", "pattern"):
        gen = gemma.generate(messages=messages(name), params=SamplingParams(
            max_tokens=100, response_format=response_format(name), speculative="prompt_lookup"))
        complete += check_output(gen.text, gen.finish_reason, SCHEMAS[name])
    assert complete >= 2

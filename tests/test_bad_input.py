"""Every kind of bad input, end to end (bench/bad_input_table.py builds the rows; python
bench/bad_input_table.py prints them as the note's table).

Real components: a private redis-server, an `rqllm worker` process running SmolLM2 with a 364-token
KV budget, `rqllm submit` / `rqllm collect` on one JSONL file, `rqllm worker` on broken model files.
Each row's place of refusal and error text are checked against the expectations below (written by
hand), and so is the worker going on. Marked slow (about 40 s on an idle 2-core machine, minutes when
it is busy); each refusal is also tested on its own in the default run (test_jobs_schemas,
test_pipeline_batch_file, test_memory_guard, test_gguf_file, test_worker_integration).
"""
from __future__ import annotations

import pytest

from bench import bad_input_table as table

pytestmark = pytest.mark.slow

SUBMISSION = "submission"
WORKER = "worker"
START = "worker start-up"

EXPECTED: dict[str, tuple[str, str]] = {
    "empty prompt": (SUBMISSION, "prompt: prompt must not be empty"),
    "whitespace-only prompt": (SUBMISSION, "prompt must not be empty (it is only whitespace)"),
    "max_tokens = 0": (SUBMISSION, "max_tokens: Input should be greater than or equal to 1 (got 0)"),
    "max_tokens < 0": (SUBMISSION, "max_tokens: Input should be greater than or equal to 1 (got -5)"),
    "max_tokens huge (10^9)": (SUBMISSION, "max_tokens: Input should be less than or equal to 1048576"),
    "temperature < 0": (SUBMISSION, "temperature: Input should be greater than or equal to 0 (got -1)"),
    "temperature > 10": (SUBMISSION, "temperature: Input should be less than or equal to 10 (got 11)"),
    "top_p = 0": (SUBMISSION, "top_p: Input should be greater than 0 (got 0)"),
    "top_p > 1": (SUBMISSION, "top_p: Input should be less than or equal to 1 (got 1.5)"),
    "invalid UTF-8 bytes in the line": (SUBMISSION, "not valid UTF-8: invalid continuation byte (byte 0xe9"),
    "lone surrogate (\\ud800) in a prompt": (SUBMISSION, "prompt is not valid UTF-8 text: surrogates not allowed"),
    "chat message with an unknown role": (SUBMISSION, "messages.[0].role: Input should be 'system', 'user' or "
                                                      "'assistant' (got 'wizard')"),
    "chat message list empty": (SUBMISSION, "messages: List should have at least 1 item"),
    "chat message content not text": (SUBMISSION, "messages.[0].content: Input should be a valid string (got 42)"),
    "50 MB prompt": (SUBMISSION, "line is 52,428,915 bytes, over the limit of 1,114,112 bytes for one request"),
    "line that is not JSON": (SUBMISSION, "invalid JSON: "),
    "line without custom_id": (SUBMISSION, "custom_id must be a non-empty string"),
    "custom_id used twice": (SUBMISSION, "custom_id already used on line 1"),
    "prompt + max_tokens over the worker's KV budget": (
        WORKER, "invalid_request: prompt (33 tokens) + max_tokens (400) = 433 tokens exceeds the KV cache "
                "capacity of 364 tokens"),
    "max_tokens over the KV budget (within the schema's limit)": (
        WORKER, "+ max_tokens (100000) = 100033 tokens exceeds the KV cache capacity of 364 tokens"),
    "prompt alone over the KV budget": (WORKER, "tokens exceeds the KV cache capacity of 364 tokens"),
    "job naming os.system written into Redis": (WORKER, "refused: RefusedJob: 'os.system' is not in an allowed "
                                                        "module"),
    "job payload that skips submission and fails the schema": (
        WORKER, "invalid_request: model: Field required"),
    "truncated GGUF (download cut short)": (START, "lies past the end of the file (49181216 bytes)"),
    "truncated inside the header": (START, "runs past the end of the file"),
    "wrong magic": (START, "not a GGUF file: magic is b'GGUX', expected b'GGUF'"),
    "garbled tensor table": (START, "name of tensor #0 is 18446744073709551615 bytes long (at most 63 allowed)"),
    "unknown architecture": (START, "unsupported architecture 'mamba'; supported: llama, qwen2, qwen3, gemma2, gemma3, phi3"),
    "unknown quant type id": (START, "tensor 'token_embd.weight' has unknown ggml type id 200"),
    "quant type we do not run (IQ4_NL)": (START, "tensor token_embd.weight has type IQ4_NL, not supported"),
    "tensor shapes that do not match the metadata": (
        START, "tensor token_embd.weight has shape [576, 49152], the metadata implies [594, 49152]"),
}


@pytest.fixture(scope="module")
def rows(smollm2_path, tmp_path_factory):
    return {r.name: r for r in table.run(tmp_path_factory.mktemp("bad-input"))}


def test_the_table_covers_every_case(rows):
    assert set(rows) == set(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_bad_input(rows, name):
    where, text = EXPECTED[name]
    row = rows[name]
    assert row.where == where, (name, row)
    assert text in row.error, (name, row.error)
    assert "\n" not in row.error and "errors.pydantic.dev" not in row.error and "Traceback" not in row.error
    assert row.went_on, (name, row.how)
    if where == START:
        assert row.error.startswith("Error: cannot use the model: bad-")  # click's one-line error, the file named

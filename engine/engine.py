"""Engine: one loaded model, its tokenizer, its KV cache; generates text for one request at a time.

Contract (used by jobs/ and pipeline/):

    eng = Engine("smollm2-135m" | "/path/model.gguf", threads=None, kv_budget="256MiB")
    eng.model_name          # str, e.g. "smollm2-135m" or the file stem
    eng.kv_capacity         # tokens the KV budget holds
    eng.tokenizer.encode(text) -> list[int]; eng.tokenizer.decode(ids) -> str
    eng.render_chat(messages: list[dict]) -> str          # chat template applied, generation prompt added
    gen = eng.generate(prompt=str | None, messages=list[dict] | None, params=SamplingParams(),
                       on_text=callable(str) | None, should_stop=callable() -> bool | None) -> Generation
        # on_text receives UTF-8-safe text pieces as they are produced; their concatenation == gen.text
        # should_stop is polled between tokens; when it returns True generation ends early with
        #   EngineInterrupted raised (the caller re-queues the job).
        # Raises EngineError (a ValueError) for bad requests: empty prompt, prompt + max_tokens over
        #   the KV capacity (message names both numbers), unknown chat roles, invalid text.
"""
from __future__ import annotations


class EngineError(ValueError):
    """A request or model file the engine refuses, with a message naming the problem."""


class EngineInterrupted(RuntimeError):
    """Generation was stopped by should_stop()."""

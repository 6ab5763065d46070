"""Engine: one loaded model, its tokenizer, its KV cache; generates text for one request at a time.

Contract (used by jobs/ and pipeline/):

    eng = Engine("smollm2-135m" | "/path/model.gguf", threads=None, kv_budget="256MiB", repack=None)
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

Consecutive requests that share a prompt prefix reuse its KV entries instead of recomputing them
(summarisation chunks share their instructions); Generation.prefix_hit_tokens says how many.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

from engine import models
from engine.model import MAX_UBATCH, Model, ModelError
from engine.params import Generation, SamplingParams
from engine.sampler import Sampler
from engine.tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    from engine.chat import ChatFormat

MAX_PROMPT_CHARS = 4_000_000  # far beyond any KV budget here; refuse before tokenizing megabytes


def release_freed_heap() -> None:
    """Give pages freed by Python and the tokenizer back to the OS (glibc malloc_trim; ~0.2 ms).
    Building the tokenizer allocates and frees tens of MB (JSON parse, vocabulary decoding) that glibc
    keeps in the heap otherwise: 22 MB (SmolLM2) and 35 MB (Gemma 3) of private memory per worker
    process; a first Gemma 3 prompt leaves ~10 MB more (bench_memory.py --pss)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim): nothing to give back
        pass


class EngineError(ValueError):
    """A request or model file the engine refuses, with a message naming the problem."""


class EngineInterrupted(RuntimeError):
    """Generation was stopped by should_stop()."""


class Engine:
    def __init__(self, model: str | os.PathLike[str], *, threads: int | None = None,
                 kv_budget: str | int = "256MiB", max_context: int | None = None, repack: bool | None = None,
                 repack_progress: Callable[[int, int], None] | None = None):
        """repack / repack_progress: Model.load's (the repacked weight cache, engine.repack)."""
        try:
            path = models.resolve(model)
            self.model = Model.load(path, threads=threads, kv_budget=kv_budget, max_context=max_context,
                                    repack=repack, repack_progress=repack_progress)
        except (ModelError, models.ModelError) as exc:
            raise EngineError(str(exc)) from None
        self.model_name = models.model_name(model)
        self.path = path
        try:
            self.tokenizer = Tokenizer.from_gguf(self.model.gguf)
        except TokenizerError as exc:
            raise EngineError(str(exc)) from None
        self._cached: list[int] = []  # tokens whose K/V sit in the cache at positions 0..
        release_freed_heap()

    @cached_property
    def chat(self) -> ChatFormat:
        """The chat format, built on first use: Jinja2 and the template's compilation (~50 ms) are not
        needed to start, nor by raw-prompt requests. A template that does not compile fails the chat
        requests (EngineError naming it), not the engine."""
        from engine.chat import ChatFormat

        return ChatFormat.from_gguf(self.model.gguf, self.tokenizer)

    @property
    def kv_capacity(self) -> int:
        return self.model.capacity

    @property
    def threads(self) -> int:
        return self.model.threads

    def render_chat(self, messages: Sequence[dict]) -> str:
        try:
            return self.chat.render(list(messages), add_generation_prompt=True)
        except ValueError as exc:  # ChatError (bad messages, broken template) is a ValueError
            raise EngineError(str(exc)) from None

    def prompt_ids(self, prompt: str | None = None, messages: Sequence[dict] | None = None) -> list[int]:
        """Token ids for a raw prompt (BOS as the GGUF says) or a chat (template renders BOS)."""
        if (prompt is None) == (messages is None):
            raise EngineError("give exactly one of prompt or messages")
        if messages is not None:
            if not messages:
                raise EngineError("messages is empty")
            text, add_bos = self.render_chat(messages), False
        else:
            text, add_bos = prompt, None
        if not isinstance(text, str):
            raise EngineError(f"prompt must be text, got {type(text).__name__}")
        if not text.strip():
            raise EngineError("prompt is empty")
        if len(text) > MAX_PROMPT_CHARS:
            raise EngineError(f"prompt is {len(text):,} characters; the limit is {MAX_PROMPT_CHARS:,}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise EngineError(f"prompt is not valid UTF-8 text: {exc.reason} at character {exc.start}") from None
        return self.tokenizer.encode(text, add_bos=add_bos)

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.kv_capacity:
            raise EngineError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} tokens "
                f"exceeds the KV cache capacity of {self.kv_capacity} tokens; shorten the prompt, lower "
                f"max_tokens or raise --kv-budget")

    def generate(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
                 params: SamplingParams | None = None, *, on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 prompt_ids: list[int] | None = None) -> Generation:
        params = params or SamplingParams()
        ids = list(prompt_ids) if prompt_ids is not None else self.prompt_ids(prompt, messages)
        if not ids:
            raise EngineError("prompt is empty")
        vocab = self.model.cfg.n_vocab
        if any(not 0 <= t < vocab for t in ids):
            raise EngineError(f"prompt ids must be in [0, {vocab})")
        self.check_fits(len(ids), params.max_tokens)

        t0 = time.perf_counter()
        start = self._reusable_prefix(ids)
        self._cached = self._cached[:start]  # what follows is about to be overwritten
        logits = self.model.forward(ids[start:], start)
        self._cached = list(ids)
        t1 = time.perf_counter()

        sampler = Sampler(params)
        penalized = params.repetition_penalty != 1.0
        stream = _TextStream(self.tokenizer, params.stop, on_text)
        out: list[int] = []
        finish = "length"
        n_decoded = 0
        for i in range(params.max_tokens):
            if should_stop is not None and should_stop():
                raise EngineInterrupted(f"stopped after {len(out)} tokens")
            # the recent tokens matter only to the repetition penalty: no per-token list copy otherwise
            token = sampler.sample(logits, ids + out if penalized else out)
            if token in self.tokenizer.eos_ids:
                finish = "stop"
                break
            out.append(token)
            if stream.push(token):
                finish = "stop"
                break
            if i + 1 < params.max_tokens:
                logits = self.model.forward([token], len(ids) + len(out) - 1)
                self._cached.append(token)
                n_decoded += 1
        text = stream.finish()
        t2 = time.perf_counter()
        prefill_s, decode_s = t1 - t0, t2 - t1
        n_prefill = len(ids) - start
        return Generation(
            text=text, prompt_ids=ids, ids=out, finish_reason=finish,
            prompt_tokens=len(ids), completion_tokens=len(out),
            prefill_seconds=prefill_s, decode_seconds=decode_s,
            prefill_tps=n_prefill / prefill_s if prefill_s > 0 else 0.0,
            decode_tps=n_decoded / decode_s if decode_s > 0 and n_decoded else 0.0,
            prefix_hit_tokens=start,
        )

    def _reusable_prefix(self, ids: list[int]) -> int:
        """How many leading prompt tokens already sit in the KV cache (at least one token is always
        recomputed, to get its logits)."""
        n = 0
        for a, b in zip(self._cached, ids):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)
        cfg = self.model.cfg
        if n and cfg.sliding_window:
            # A sliding-window layer's ring holds only the last window + MAX_UBATCH - 1 positions of
            # the cached sequence; reuse only if every key the new tokens need is still there.
            if n < len(self._cached) - MAX_UBATCH + 1:
                return 0
        return n


class _TextStream:
    """Token ids -> text pieces for on_text, holding back what could still become a stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], on_text: Callable[[str], None] | None):
        self.decoder = tokenizer.stream_decoder()
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.on_text = on_text
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of self.text already given to on_text

    def push(self, token: int) -> bool:
        """Add a token; True when a stop string has appeared."""
        self.text += self.decoder.push(token)
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                self.text = self.text[:at]
                return True
        self._emit(len(self.text) - self.hold)
        return False

    def finish(self) -> str:
        if not any(s in self.text for s in self.stops):
            self.text += self.decoder.flush()
        for stop in self.stops:  # a stop string completed by the flush
            at = self.text.find(stop)
            if at >= 0:
                self.text = self.text[:at]
        self._emit(len(self.text))
        return self.text

    def _emit(self, upto: int) -> None:
        if upto > self.sent:
            if self.on_text is not None:
                self.on_text(self.text[self.sent:upto])
            self.sent = upto

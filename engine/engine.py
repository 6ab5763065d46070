"""Engine: one loaded model, its tokenizer, its KV cache; generates text for one request at a time.

Contract (used by jobs/ and pipeline/):

    eng = Engine("smollm2-135m" | "/path/model.gguf", threads=None, kv_budget="256MiB", repack=None,
                 draft=None | "model", speculative="off" | "prompt_lookup" | "draft")
    eng.model_name          # str, e.g. "smollm2-135m" or the file stem
    eng.kv_capacity         # tokens the KV budget holds
    eng.tokenizer.encode(text) -> list[int]; eng.tokenizer.decode(ids) -> str
    eng.render_chat(messages: list[dict]) -> str          # chat template applied, generation prompt added
    eng.chat_capability.can_chat / .describe(name)        # False: a base model (warn at chat requests)
    gen = eng.generate(prompt=str | None, messages=list[dict] | None, params=SamplingParams(),
                       on_text=callable(str) | None, should_stop=callable() -> bool | None,
                       owner=str | None) -> Generation
        # on_text receives UTF-8-safe text pieces as they are produced; their concatenation == gen.text
        # should_stop is polled between tokens; when it returns True generation ends early with
        #   EngineInterrupted raised (the caller re-queues the job).
        # Raises EngineError (a ValueError) for bad requests: empty prompt, prompt + max_tokens over
        #   the KV capacity (message names both numbers), unknown chat roles, invalid text.
        # params.end_at_sentence: a text cut by max_tokens ends after its last complete sentence or
        #   line (gen.ids still holds every generated token); on_text gets text only up to such ends.
        # params.logprobs = n: gen.logprobs holds each token of gen.ids with its log-probability and the
        #   n most likely tokens at its position (engine.logprobs).

Consecutive requests that share a prompt prefix reuse its KV entries instead of recomputing them
(summarisation chunks share their instructions); Generation.prefix_hit_tokens says how many. Only
requests of the same `owner` share them (None is an owner too): a request of another owner starts
from an empty cache, so neither its hit count nor its prefill time says anything of earlier prompts.

Speculative decoding (engine.speculative): params.speculative, else the engine's `speculative`
default, picks how tokens are guessed - prompt lookup, or the draft model loaded with `draft` (same
vocabulary, checked). Greedy output is plain greedy's token for token; sampled output has the same
distribution. Generation.draft_tokens / accepted_tokens say how many guesses were checked / kept.
The first speculative requests time passes of 1..16 tokens past their prompts (engine.speculative.
PassTimer; ~0.1 s each for these models, counted as neither prefill nor decode time); the costs steer
the draft lengths.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

from engine import registry
from engine.drafting import DraftModel, PromptLookup, VocabularyMismatch, check_same_vocabulary
from engine.kv_cache import CachedTokens
from engine.logprobs import LogprobRecorder
from engine.model import MAX_UBATCH, Model, ModelError
from engine.params import Generation, SamplingParams, SpeculativeMode
from engine.sampler import Sampler
from engine.sentences import complete_end, open_fence_start, sentence_ends, trim_to_complete
from engine.speculative import DEFAULT_PASS_COSTS, MAX_DRAFT, Decoder, DraftPolicy, PassTimer, Proposer
from engine.tokenizer import Tokenizer, TokenizerError
from engine.defaults import DEFAULT_KV_BUDGET

if TYPE_CHECKING:
    from engine.chat import ChatFormat
    from engine.constraint import Constraint
    from engine.chat_capability import ChatCapability

log = logging.getLogger("rqllm.engine")
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
                 kv_budget: str | int = DEFAULT_KV_BUDGET, max_context: int | None = None, repack: bool | None = None,
                 repack_progress: Callable[[int, int], None] | None = None, draft: str | os.PathLike[str] | None = None,
                 speculative: SpeculativeMode = "off"):
        """repack / repack_progress: Model.load's (the repacked weight cache, engine.repack).
        draft: a draft model for speculative decoding (a smaller GGUF with the same vocabulary); its
        KV cache holds as many positions as the target's. speculative: the mode for requests that do
        not choose one ("draft" needs `draft`)."""
        if speculative == "draft" and draft is None:
            raise EngineError("speculative='draft' needs a draft model (draft=MODEL, --draft MODEL)")
        try:
            path = registry.resolve(model)
            self.model = Model.load(path, threads=threads, kv_budget=kv_budget, max_context=max_context,
                                    repack=repack, repack_progress=repack_progress)
        except ModelError as exc:
            raise EngineError(str(exc)) from None
        self.model_name = registry.model_name(model)
        self.path = path
        try:
            self.tokenizer = Tokenizer.from_gguf(self.model.gguf)
        except TokenizerError as exc:
            raise EngineError(str(exc)) from None
        # tokens whose K/V sit in the cache at positions 0..
        self._cache = CachedTokens(MAX_UBATCH - 1 if self.model.cfg.sliding_window else None)
        self._cache_owner: str | None = None  # whose request wrote what the caches hold
        self.draft = self._load_draft(draft, repack) if draft is not None else None
        self.speculative: SpeculativeMode = speculative
        # engine.speculative: timed at the first speculative requests, or set_speculation_costs()
        self._timer = PassTimer()
        self._fixed_costs: list[float] | None = None
        release_freed_heap()

    def _load_draft(self, draft: str | os.PathLike[str], repack: bool | None) -> DraftModel:
        try:
            path = registry.resolve(draft)
            model = Model.load(path, threads=self.model.threads, kv_budget=1 << 40, max_context=self.kv_capacity,
                               repack=repack)
            check_same_vocabulary(self.model.gguf, model.gguf)
        except (ModelError, VocabularyMismatch) as exc:
            raise EngineError(f"draft model: {exc}") from None
        if model.capacity < self.kv_capacity:
            raise EngineError(f"draft model {path.name} holds {model.capacity} positions (its context length), "
                              f"fewer than the target's KV capacity of {self.kv_capacity}; lower --kv-budget")
        draft_model = DraftModel(model, registry.model_name(draft))
        # Decode steps read the weights once each: until timed, the files' sizes give a guess's cost
        draft_model.cost_per_guess = model.gguf.size / self.model.gguf.size
        return draft_model

    @cached_property
    def chat(self) -> ChatFormat:
        """The chat format, built on first use: Jinja2 and the template's compilation (~50 ms) are not
        needed to start, nor by raw-prompt requests. A template that does not compile fails the chat
        requests (EngineError naming it), not the engine."""
        from engine.chat import ChatFormat

        return ChatFormat.from_gguf(self.model.gguf, self.tokenizer)

    @cached_property
    def chat_capability(self) -> ChatCapability:
        """Whether the model can follow chat prompts (engine.chat_capability): callers warn when not."""
        from engine.chat_capability import chat_capability

        return chat_capability(self.model.gguf.metadata, self.path)

    @property
    def kv_capacity(self) -> int:
        return self.model.capacity

    @property
    def threads(self) -> int:
        return self.model.threads

    def forget_cache(self) -> None:
        """Reuse no prompt prefix in the next request (benchmarks that must repeat the same work)."""
        self._cache.begin(0)
        if self.draft is not None:
            self.draft.cache.begin(0)

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
                 prompt_ids: list[int] | None = None, owner: str | None = None) -> Generation:
        params = params or SamplingParams()
        ids = list(prompt_ids) if prompt_ids is not None else self.prompt_ids(prompt, messages)
        if not ids:
            raise EngineError("prompt is empty")
        vocab = self.model.cfg.n_vocab
        if any(not 0 <= t < vocab for t in ids):
            raise EngineError(f"prompt ids must be in [0, {vocab})")
        self.check_fits(len(ids), params.max_tokens)

        mode = params.speculative or self.speculative
        if mode == "draft" and self.draft is None:
            raise EngineError("speculative decoding with a draft model was asked for, but this engine has no "
                              "draft model (start it with --draft MODEL)")

        if owner != self._cache_owner:
            # Another tenant's prefix must not be reused: a hit (or a faster prefill) would tell this
            # request which tokens the earlier prompt had.
            self.forget_cache()
            self._cache_owner = owner
        t0 = time.perf_counter()
        start = self._cache.reusable(ids)
        self._cache.begin(start)  # what follows is about to be overwritten
        logits = self.model.forward(ids[start:], start)
        self._cache.wrote(ids, len(ids))
        if mode == "draft":
            self.draft.prefill(ids)  # here, so that decode time counts decoding only
        t1 = time.perf_counter()

        sampler = Sampler(params, prompt_len=len(ids), constraint=self._constraint(params))
        if mode != "off" and self._fixed_costs is None and not self._timer.done:
            logits = logits.copy()  # the model's logits array is reused by the passes timed here
            self._time_passes(len(ids))
        t_decode = time.perf_counter()  # the timing of passes above is neither prefill nor decode
        proposer = self._proposer(mode, sampler)
        policy = None if proposer is None else DraftPolicy(self.pass_costs, proposer.cost_per_guess,
                                                           prior_alpha=proposer.prior_alpha)
        recorder = None if params.logprobs is None else LogprobRecorder(self.tokenizer, params.logprobs)
        decoder = Decoder(self.model, sampler, list(ids), logits, proposer, policy,
                          on_decided=None if recorder is None else recorder.add)
        out: list[int] = []
        constraint = sampler.constraint
        complete_after = None if constraint is None or not params.stop else (
            lambda n: constraint.completes(out[:n]))
        stream = _TextStream(self.tokenizer, params.stop, on_text, params.end_at_sentence, complete_after)
        finish = "length"
        decided = 0  # tokens decided, EOS included
        try:
            while finish == "length" and len(out) < params.max_tokens:
                if should_stop is not None and should_stop():
                    raise EngineInterrupted(f"stopped after {len(out)} tokens")
                for token in decoder.step(params.max_tokens - len(out)):
                    decided += 1
                    if token in self.tokenizer.eos_ids:
                        finish = "stop"
                        break
                    out.append(token)
                    if stream.push(token):
                        finish = "stop"
                        break
        finally:
            self._cache.wrote(decoder.context[:decoder.kv_tokens], decoder.kv_end)
        text = stream.finish(length_cut=finish == "length")
        t2 = time.perf_counter()
        prefill_s, decode_s = t1 - t0, t2 - t_decode
        n_prefill = len(ids) - start
        n_decoded = decided - 1  # the first token comes from the prefill's logits
        return Generation(
            text=text, prompt_ids=ids, ids=out, finish_reason=finish,
            prompt_tokens=len(ids), completion_tokens=len(out),
            prefill_seconds=prefill_s, decode_seconds=decode_s,
            prefill_tps=n_prefill / prefill_s if prefill_s > 0 else 0.0,
            decode_tps=n_decoded / decode_s if decode_s > 0 and n_decoded > 0 else 0.0,
            prefix_hit_tokens=start, draft_tokens=decoder.draft_tokens, accepted_tokens=decoder.accepted_tokens,
            # decided tokens come in order, and `out` is a prefix of them (EOS and tokens after a stop are not in it)
            logprobs=None if recorder is None else recorder.entries[:len(out)],
        )

    @property
    def pass_costs(self) -> list[float]:
        """What a pass of n = 1..MAX_DRAFT + 1 tokens costs over a one-token pass, as speculative
        decoding's draft lengths assume it (index 0 unused)."""
        return self._fixed_costs or self._timer.costs() or list(DEFAULT_PASS_COSTS)

    def set_speculation_costs(self, pass_costs: Sequence[float], draft_step: float | None = None) -> None:
        """Choose draft lengths with these costs instead of timed ones (tests, benchmarks): pass_costs[n]
        = an n-token pass's time over a one-token pass, n = 1..MAX_DRAFT + 1 (pass_costs[0] unused);
        draft_step = a draft-model step's time over a target step."""
        if len(pass_costs) != MAX_DRAFT + 2 or any(not c > 0 for c in pass_costs[1:]):
            raise ValueError(f"pass_costs needs {MAX_DRAFT + 2} entries, positive from index 1")
        self._fixed_costs = list(pass_costs)
        if draft_step is not None:
            if self.draft is None:
                raise ValueError("no draft model loaded")
            self.draft.cost_per_guess = draft_step

    def _time_passes(self, pos: int) -> None:
        """One PassTimer timing at positions pos.. past the prompt (written again later, like rejected
        guesses); a request without that much room leaves it to a later one."""
        n = MAX_DRAFT + 1
        if pos + n > self.kv_capacity:
            return
        self._timer.time_once(self.model, pos, self.draft.model if self.draft is not None else None)
        self._cache.wrote(self._cache.tokens, pos + n)
        if self.draft is not None:
            self.draft.cache.wrote(self.draft.cache.tokens, pos + 1)
            self.draft.cost_per_guess = self._timer.draft_step()
        if self._timer.done:
            log.info("speculative decoding: pass costs over a one-token pass %s%s",
                     [round(c, 2) for c in self.pass_costs[1:]],
                     f"; draft step {self.draft.cost_per_guess:.2f}" if self.draft is not None else "")

    def _constraint(self, params: SamplingParams) -> Constraint | None:
        """The matcher for params.response_format (engine.constraint); None without one."""
        if params.response_format is None:
            return None
        from engine.constraint import Constraint, ConstraintError

        try:
            return Constraint.for_format(params.response_format, self.tokenizer, self.model.cfg.n_vocab)
        except ConstraintError as exc:
            raise EngineError(f"response_format: {exc}") from None

    def _proposer(self, mode: SpeculativeMode, sampler: Sampler) -> Proposer | None:
        """The guesser for a request; None: plain decoding."""
        if mode == "off":
            return None
        if mode == "prompt_lookup":
            return PromptLookup()
        return self.draft.proposer(sampler)


class _TextStream:
    """Token ids -> text pieces for on_text, holding back what could still become a stop string and,
    with end_at_sentence, what follows the last complete sentence (max_tokens may cut it off)."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], on_text: Callable[[str], None] | None,
                 end_at_sentence: bool = False, complete_after: Callable[[int], bool] | None = None):
        """complete_after(n): whether the first n tokens are a complete value (under a constraint; None:
        no constraint). A stop string then ends the text only where it starts right after such a
        prefix; anywhere else (inside a JSON string, say) it belongs to the value."""
        self.decoder = tokenizer.stream_decoder()
        self.stops = stops
        self.complete_after = complete_after
        self._ends: dict[int, int] = {}  # under a constraint: len(text) -> the fewest tokens that give it
        self._pushed = 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.on_text = on_text
        self.end_at_sentence = end_at_sentence
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of self.text already given to on_text
        self._complete = 0  # text[:_complete] ends with a sentence or line that is surely complete
        self._scan_from = 0

    def push(self, token: int) -> bool:
        """Add a token; True when a stop string has appeared."""
        self.text += self.decoder.push(token)
        self._pushed += 1
        if self.complete_after is not None:
            self._ends.setdefault(len(self.text), self._pushed)
        at = self._stop_at(self.sent)
        if at is not None:
            self.text = self.text[:at]
            return True
        upto = len(self.text) - self.hold
        self._emit(min(upto, self._complete_upto()) if self.end_at_sentence else upto)
        return False

    def _stop_at(self, sent: int) -> int | None:
        """Where the text is cut for the first stop string (in the order given) that has appeared since
        `sent` characters were given out; None: none has (or, under a constraint, none after a complete
        value)."""
        for stop in self.stops:
            at = self._find_stop(stop, max(0, sent - len(stop)))
            if at is not None:
                return at
        return None

    def _find_stop(self, stop: str, start: int) -> int | None:
        """The first occurrence of `stop` from `start` that may end the text (see __init__)."""
        at = self.text.find(stop, start)
        while at >= 0 and self.complete_after is not None:
            n = self._ends.get(at)  # a cut inside a token is never after a complete value
            if n is not None and self.complete_after(n):
                break
            at = self.text.find(stop, at + 1)
        return at if at >= 0 else None

    def _complete_upto(self) -> int:
        """The end of the last sentence or line known complete: an end at the very end of the text
        so far is not known yet ("3." may become "3.5", a closing quote may follow)."""
        for end in sentence_ends(self.text, self._scan_from):
            if end < len(self.text):
                self._complete = max(self._complete, end)
        self._scan_from = max(0, len(self.text) - 16)  # room for a run of marks and closers
        line = self.text.rfind("\n", self._complete + 1)
        if line >= 0:
            self._complete = max(self._complete, len(self.text[:line].rstrip()))
        fence = open_fence_start(self.text[:self._complete])
        # inside a code block that may never close: only up to what precedes the block
        return self._complete if fence is None else complete_end(self.text[:fence])

    def finish(self, length_cut: bool = False) -> str:
        """The whole text; length_cut: max_tokens ended it (then, with end_at_sentence, the text ends
        after its last complete sentence or line, if it has one)."""
        if self._stop_at(0) is None:
            self.text += self.decoder.flush()
        for stop in self.stops:  # a stop string completed by the flush
            at = self._find_stop(stop, 0)
            if at is not None:
                self.text = self.text[:at]
        if length_cut and self.end_at_sentence:
            self.text = trim_to_complete(self.text)
        self._emit(len(self.text))
        return self.text

    def _emit(self, upto: int) -> None:
        if upto > self.sent:
            if self.on_text is not None:
                self.on_text(self.text[self.sent:upto])
            self.sent = upto

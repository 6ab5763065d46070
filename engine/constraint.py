"""Constrained decoding (structured outputs): at every step only tokens that keep the text valid for a
grammar - compiled from a JSON schema, from `json_object` (any JSON object) or from a regex - may be
chosen. The grammar engine is llguidance (also used by llama.cpp and vLLM); we give it our tokenizer's
token bytes, so every model we load works.

A Constraint follows the generated tokens rather than being driven token by token: the sampler hands
it the tokens generated so far (plus any guesses being checked), and the matcher consumes what it has
not seen and rolls back what is no longer there. So speculative decoding needs nothing special - a
rejected guess is rolled back by the next sync, as its K/V is overwritten by the next pass - and a
draft model's own sampling is constrained too. Guesses from prompt lookup are cut at the first token
the grammar refuses before the model checks them (Decoder._draft).

EOS is allowed only when the grammar is satisfied (llguidance masks it otherwise), so a generation
ends with "stop" only on a complete value; one cut by max_tokens ends with "length". For the same
reason a stop string ends a constrained generation only where the text before it is a complete value
(`completes`, asked by the engine's text stream); elsewhere it is part of the value.
"""
from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

if TYPE_CHECKING:
    from engine.params import ResponseFormat
    from engine.tokenizer import Tokenizer

log = logging.getLogger("rqllm.engine")

# JSON as a model writes it in prose (", " and ": "), with no other whitespace: with free whitespace
# small models can pad with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A response_format whose grammar does not compile (message from llguidance)."""


def grammar_for(fmt: ResponseFormat) -> str | None:
    """The llguidance grammar for a response_format; None for plain text."""
    if fmt.type == "text":
        return None
    if fmt.type == "regex":
        return LLMatcher.grammar_from_regex(fmt.regex or "")
    schema = {"type": "object"} if fmt.type == "json_object" else fmt.json_schema.schema_
    try:
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), JSON_OPTIONS)
    except ValueError as exc:
        raise ConstraintError(f"the schema is not usable: {exc}") from None


def grammar_error(fmt: ResponseFormat) -> str | None:
    """Why the format's grammar does not compile, or None. Needs no tokenizer (producers have none):
    what a tokenizer could add is token-level, not the schema's validity."""
    try:
        grammar = grammar_for(fmt)
    except ConstraintError as exc:
        return str(exc)
    if grammar is None:
        return None
    message = LLMatcher.validate_grammar(grammar)
    return " ".join(message.split()) or None


class _TokenSource:
    """What llguidance's TokenizerWrapper reads of a tokenizer: token bytes by id, EOS/BOS, specials."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eos_ids, default=0)
        self.bos_token_id = tok.bos_id
        # control/unknown tokens and those that render as nothing can never be part of the text
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i) or not self.tokens[i]]

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8", "replace"), add_bos=False, parse_special=False, add_eos=False)


_LL_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, dict[int, LLTokenizer]] = weakref.WeakKeyDictionary()


def ll_tokenizer(tok: Tokenizer, n_vocab: int) -> LLTokenizer:
    """llguidance's view of our tokenizer, built once per tokenizer (a 150k vocabulary takes ~0.3 s)."""
    per_size = _LL_TOKENIZERS.setdefault(tok, {})
    if n_vocab not in per_size:
        eos = sorted(tok.eos_ids) or None
        per_size[n_vocab] = LLTokenizer(TokenizerWrapper(_TokenSource(tok)), n_vocab=n_vocab, eos_token=eos)
    return per_size[n_vocab]


class Constraint:
    """A matcher for one generation. n_vocab: the model's logits width (may exceed the vocabulary)."""

    def __init__(self, tok: Tokenizer, grammar: str, n_vocab: int):
        self.matcher = LLMatcher(ll_tokenizer(tok, n_vocab), grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.n_vocab = n_vocab
        self.eos_ids = frozenset(tok.eos_ids)
        self._eos_index = np.array(sorted(tok.eos_ids), dtype=np.int64)
        self.consumed: list[int] = []  # generated tokens the matcher has taken, in order
        self._bits = np.zeros((1, (n_vocab + 31) // 32), dtype=np.int32)
        self._fresh = False  # _bits and _allowed_ids / _mask hold the current state's mask
        self._allowed_ids: np.ndarray | None = None  # the ids the current state allows (when few)
        self._mask: np.ndarray | None = None  # or as booleans over the logits (when many)
        self._blocked: np.ndarray | None = None  # the ids it refuses, when fewer than half
        # apply()'s output, reused from call to call: all -inf but at _shown (None: anywhere)
        self._out: np.ndarray | None = None
        self._shown: np.ndarray | None = None

    @classmethod
    def for_format(cls, fmt: ResponseFormat | None, tok: Tokenizer, n_vocab: int) -> Constraint | None:
        grammar = None if fmt is None else grammar_for(fmt)
        return None if grammar is None else cls(tok, grammar, n_vocab)

    def sync(self, generated: Sequence[int]) -> None:
        """Bring the matcher to the state after `generated` (rolling back what it took beyond their
        common prefix, consuming the rest)."""
        n = len(self.consumed)
        if len(generated) >= n and generated[:n] == self.consumed:  # the usual case: one token more
            common = n
        else:  # a rejected guess, or `generated` is not a list
            common = 0
            while common < min(n, len(generated)) and self.consumed[common] == generated[common]:
                common += 1
        if common < n:
            self.matcher.rollback(n - common)
            del self.consumed[common:]
            self._fresh = False
        for t in generated[common:]:
            t = int(t)
            if t in self.eos_ids:
                break  # generation ends at EOS: nothing follows it to match
            self.matcher.consume_token(t)
            self.consumed.append(t)
            self._fresh = False

    def _compute(self) -> None:
        """The current state's mask: its ids (_allowed_ids) when few, else booleans (_mask) and the
        refused ids (_blocked) when fewer than half. A matcher in an error state (masked sampling
        cannot reach one) allows EOS only, as does an empty mask."""
        if self.matcher.is_error():
            log.warning("constrained decoding: matcher error (%s); ending the text", self.matcher.get_error())
            self._bits[:] = 0
        else:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        words = np.flatnonzero(self._bits[0])
        self._blocked = None
        if len(words) > len(self._bits[0]) // 8:  # many tokens allowed (inside a string): a boolean mask
            self._mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.n_vocab].view(bool)
            blocked = np.flatnonzero(~self._mask)
            if len(blocked) < self.n_vocab // 2:
                self._blocked, self._allowed_ids = blocked, None
            else:
                self._allowed_ids = np.flatnonzero(self._mask)
        else:  # a few: unpack only the 32-bit words that have any
            rows, cols = np.nonzero(np.unpackbits(self._bits[0, words].view(np.uint8), bitorder="little")
                                    .reshape(len(words), 32))
            ids = words[rows] * 32 + cols
            if len(ids) == 0:
                ids = self._eos_index
            elif ids[-1] >= self.n_vocab:  # (the last word's padding bits: never set by llguidance)
                ids = ids[ids < self.n_vocab]
            self._allowed_ids = ids
            self._mask = None
        self._fresh = True

    def allowed(self) -> np.ndarray:
        """Boolean mask over the logits: the tokens the grammar allows next (EOS when it is satisfied)."""
        if not self._fresh:
            self._compute()
        if self._mask is not None:
            return self._mask
        mask = np.zeros(self.n_vocab, dtype=bool)
        mask[self._allowed_ids] = True
        return mask

    def apply(self, logits: np.ndarray, generated: Sequence[int]) -> np.ndarray:
        """logits with the tokens not allowed after `generated` at -inf. The array is the Constraint's
        own and the next call overwrites it: callers use it at once (argmax, a distribution)."""
        self.sync(generated)
        if not self._fresh:
            self._compute()
        out = self._out
        if out is None or out.shape != logits.shape or out.dtype != logits.dtype:
            out = self._out = np.full_like(logits, -np.inf)
            self._shown = None
        ids = self._allowed_ids
        if ids is None:  # most allowed (inside a string): copy all, then refuse the few
            np.copyto(out, logits)
            out[self._blocked] = -np.inf
            self._shown = None
        else:  # few: undo the last call's ids, copy these (no pass over the whole vocabulary)
            if self._shown is None:
                out.fill(-np.inf)
            else:
                out[self._shown] = -np.inf
            out[ids] = logits[ids]
            self._shown = ids
        return out

    def completes(self, generated: Sequence[int]) -> bool:
        """Whether `generated` is a complete value (the grammar accepts it as it is)."""
        self.sync(generated)
        return self.matcher.is_accepting()

    def valid_prefix(self, generated: Sequence[int], guesses: Sequence[int]) -> int:
        """How many leading guesses (after `generated`) the grammar allows; an EOS guess ends them."""
        self.sync(generated)
        cut = len(guesses)
        for i, t in enumerate(guesses):
            if int(t) in self.eos_ids:
                cut = i
                break
        return self.matcher.validate_tokens(list(guesses[:cut])) if cut else 0

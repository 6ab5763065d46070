"""Where speculative decoding's guesses come from (engine.speculative.Proposer):

* PromptLookup: the tokens that followed the latest earlier occurrence of the last few tokens, in
  the prompt and the text so far (summaries and answers about a document copy its phrases);
* DraftModel: a smaller model with the same vocabulary, decoding ahead greedily, or sampling with
  the request's settings (its distribution q then goes with each guess for the acceptance rule).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.kv_cache import CachedTokens
from engine.model import MAX_UBATCH, Model
from engine.sampler import Sampler
from engine.speculative import Draft

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile


class PromptLookup:
    """Prompt-lookup guesses for one sequence: match the context's last n tokens (n = max_ngram down
    to min_ngram) against earlier text and propose what followed the latest match."""

    cost_per_guess = 0.0  # a dictionary lookup
    free = True
    prior_alpha = 0.5

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        # n -> {n tokens: the position right after their latest occurrence that has a follower}
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # positions e < _indexed have had their n-grams ending at e entered

    def propose(self, context: list[int], k: int, sampler: Sampler | None = None) -> Draft:
        self._extend(context)
        end = len(context)
        for n in self.sizes:
            if end < n:
                continue
            at = self._index[n].get(tuple(context[end - n:]))
            if at is not None:
                return Draft(context[at:at + k], kind=n)
        return Draft([])

    def _extend(self, context: list[int]) -> None:
        # The n-gram ending right before position e gets e once context[e] exists (a match needs a
        # follower); the latest occurrence wins.
        for e in range(max(self._indexed, 1), len(context)):
            for n, index in self._index.items():
                if e >= n:
                    index[tuple(context[e - n:e])] = e
        self._indexed = max(self._indexed, len(context))


class DraftModel:
    """A draft model loaded next to the target: its weights, its own KV cache (as many positions as
    the target's) and which tokens that cache holds, reused across rounds and requests."""

    def __init__(self, model: Model, name: str):
        self.model = model
        self.name = name
        self.cache = CachedTokens(MAX_UBATCH - 1 if model.cfg.sliding_window else None)
        self.cost_per_guess = 1.0  # set by the engine from measured passes (draft step / target step)

    def prefill(self, ids: list[int]) -> None:
        """Bring the draft's cache up to `ids` (reusing what it holds of them)."""
        start = self.cache.reusable(ids)
        self.cache.begin(start)
        self.model.forward(ids[start:], start)
        self.cache.wrote(ids, len(ids))

    def proposer(self, sampler: Sampler) -> DraftModelProposer:
        """A proposer for one request sampled by `sampler`; its draws come from a stream spawned
        from the sampler's (independent of it - the acceptance test's uniforms must not repeat
        the draft's - and as reproducible as the seed)."""
        return DraftModelProposer(self, sampler.rng.spawn(1)[0])


class DraftModelProposer:
    """Guesses for one request from a DraftModel; `rng` draws the sampled guesses."""

    def __init__(self, draft: DraftModel, rng: np.random.Generator):
        self.draft = draft
        self.rng = rng
        self.cost_per_guess = draft.cost_per_guess
        self.free = False
        # A model with the same vocabulary agrees with it most of the time (a Q4_0 requantisation of
        # Gemma 3: 93-99 % of guesses kept): start there rather than at 1/2, where a costly draft
        # would not be used at all until its occasional tries, each making it catch up, proved it.
        self.prior_alpha = 0.8

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Draft:
        model, cache = self.draft.model, self.draft.cache
        k = min(k, model.capacity - len(context))
        if k <= 0:
            return Draft([])
        start = cache.reusable(context)
        cache.begin(start)
        logits = model.forward(context[start:], start)
        tokens: list[int] = []
        probs: list[tuple[np.ndarray, np.ndarray]] | None = None if sampler.greedy else []
        try:
            for i in range(k):
                if probs is None:
                    token = sampler.sample(logits, context, tokens)
                else:
                    ids, p = sampler.distribution(logits, context, tokens)
                    token = int(ids[self.rng.choice(len(ids), p=p)])
                    probs.append((ids, p))
                tokens.append(token)
                if i + 1 < k:
                    logits = model.forward([token], len(context) + i)
        finally:
            cache.wrote(context + tokens[:-1], len(context) + max(len(tokens) - 1, 0))
        return Draft(tokens, probs)


class VocabularyMismatch(ValueError):
    """The draft model's vocabulary is not the target's."""


def check_same_vocabulary(target: GGUFFile, draft: GGUFFile) -> None:
    """Raise VocabularyMismatch naming the first difference between the two GGUFs' vocabularies."""
    where = f"draft model {draft.path.name} cannot draft for {target.path.name}"
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        a, b = target.get(key), draft.get(key)
        if a != b:
            raise VocabularyMismatch(f"{where}: {key} is {b!r}, the target's is {a!r}")
    ours, theirs = target.get("tokenizer.ggml.tokens"), draft.get("tokenizer.ggml.tokens")
    if not isinstance(ours, list) or not isinstance(theirs, list):
        raise VocabularyMismatch(f"{where}: a vocabulary (tokenizer.ggml.tokens) is missing")
    if len(ours) != len(theirs):
        raise VocabularyMismatch(f"{where}: its vocabulary has {len(theirs)} tokens, the target's {len(ours)}")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            raise VocabularyMismatch(f"{where}: token {i} is {b!r}, the target's is {a!r} (not the same vocabulary)")

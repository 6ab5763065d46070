"""Turning logits into the next token: penalties, the no-repeat n-gram guard, temperature, top-k,
top-p, min-p, seed.

Same seed + same logits + same history -> same tokens. Greedy (temperature 0) is a plain argmax.

History: callers pass the whole sequence so far (`context`: prompt, then generated tokens) and, for
tokens still being checked (speculative decoding's guesses, a draft's own tokens), `extra` after
it. The sampler knows where the prompt ends (prompt_len), because the penalties differ in what
they look at:

* repetition_penalty (llama.cpp's repeat penalty): the last PENALTY_WINDOW tokens, prompt
  included, as llama-server counts them (it feeds the prompt to its penalty window);
* frequency_penalty / presence_penalty (OpenAI's definition: logit -= count * frequency +
  (count > 0) * presence, count = times the token was sampled before this position): the
  generated tokens only. llama.cpp applies the same formula over its last-64 window; counting the
  prompt would push a summary away from the very words of its document;
* no_repeat_ngram_size = n: a token that would complete an n-gram already present in the
  generated tokens gets probability 0 (its logit becomes -inf). The prompt is not searched, for the
  same reason: quoting the document is fine, looping on one's own words is not.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine.params import SamplingParams

if TYPE_CHECKING:
    from engine.constraint import Constraint

PENALTY_WINDOW = 64  # recent tokens the repetition penalty looks at (llama.cpp's default)
NUCLEUS_PREFILTER = 4096  # candidates sorted before falling back to sorting the whole vocabulary


class Sampler:
    def __init__(self, params: SamplingParams, prompt_len: int = 0, constraint: Constraint | None = None):
        """prompt_len: how many leading tokens of the contexts given to sample() are the prompt.
        constraint: only the tokens it allows after the generated ones (and `extra`) may be chosen."""
        self.params = params
        self.prompt_len = prompt_len
        self.constraint = constraint
        self.rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    def sample(self, logits: np.ndarray, context: Sequence[int], extra: Sequence[int] = ()) -> int:
        """The next token after context + extra."""
        logits = self.penalized(logits, context, extra)
        if self.greedy:
            return int(np.argmax(logits))
        ids, probs = self._distribution(logits)
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def penalized(self, logits: np.ndarray, context: Sequence[int], extra: Sequence[int] = ()) -> np.ndarray:
        """The logits after the penalties, the n-gram guard and the constraint's mask for the history
        context + extra (the same array when none applies)."""
        out = self._penalties(logits, context, extra)
        if self.constraint is not None:
            generated = [*context[self.prompt_len:], *extra]
            masked = self.constraint.apply(out, generated)
            if out is not logits and masked.max() == -np.inf:
                # the n-gram guard banned every token the grammar allows: the grammar wins
                masked = self.constraint.apply(logits, generated)
            out = masked
        return out

    def _penalties(self, logits: np.ndarray, context: Sequence[int], extra: Sequence[int] = ()) -> np.ndarray:
        p = self.params
        out = logits
        if p.repetition_penalty != 1.0:
            recent = [*context[-PENALTY_WINDOW:], *extra][-PENALTY_WINDOW:]
            if recent:
                out = apply_repetition_penalty(out, recent, p.repetition_penalty)
        if p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 and p.no_repeat_ngram_size == 0:
            return out
        generated = [*context[self.prompt_len:], *extra]
        if not generated:
            return out
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            out = apply_frequency_presence_penalties(out, generated, p.frequency_penalty, p.presence_penalty)
        if p.no_repeat_ngram_size:
            banned = repeated_ngram_completions(generated, p.no_repeat_ngram_size)
            if 0 < len(banned) < len(out):  # (everything banned - a tiny vocabulary - bans nothing)
                out = out.copy() if out is logits else out
                out[banned] = -np.inf
        return out

    def distribution(self, logits: np.ndarray, context: Sequence[int],
                     extra: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, their probabilities) that sample() draws from; greedy: the argmax, probability 1.
        Speculative sampling (engine.speculative) accepts or corrects draft tokens against it."""
        logits = self.penalized(logits, context, extra)
        if self.greedy:
            return np.array([int(np.argmax(logits))]), np.ones(1)
        return self._distribution(logits)

    def _distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = self.params
        n = logits.shape[0]
        if 0 < p.top_k < n:
            candidates = np.argpartition(logits, n - p.top_k)[n - p.top_k:]
        else:
            candidates = None
        values = (logits if candidates is None else logits[candidates]).astype(np.float64) / p.temperature
        probs = np.exp(values - values.max())
        probs /= probs.sum()
        ids = np.arange(n) if candidates is None else candidates

        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs.max()
            ids, probs = ids[keep], probs[keep]
        if p.top_p < 1.0:
            ids, probs = _nucleus(ids, probs, p.top_p)
        return ids, probs / probs.sum()


def apply_repetition_penalty(logits: np.ndarray, recent: list[int], penalty: float) -> np.ndarray:
    """llama.cpp / CTRL style: positive logits divided by the penalty, negative ones multiplied."""
    out = logits.copy()
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_frequency_presence_penalties(logits: np.ndarray, generated: Sequence[int], frequency: float,
                                       presence: float) -> np.ndarray:
    """OpenAI's: logit[t] -= count(t) * frequency + (count(t) > 0) * presence, count over `generated`."""
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    out = logits.copy()
    out[ids] -= (counts * frequency + presence).astype(out.dtype)
    return out


def repeated_ngram_completions(generated: Sequence[int], n: int) -> np.ndarray:
    """The tokens t for which generated[-(n-1):] + [t] is an n-gram already in `generated` (for
    n = 1: every generated token)."""
    seq = np.asarray(generated, dtype=np.int64)
    if n == 1:
        return np.unique(seq)
    if len(seq) < n:
        return seq[:0]
    windows = np.lib.stride_tricks.sliding_window_view(seq, n)
    hits = np.all(windows[:, :-1] == seq[len(seq) - n + 1:], axis=1)
    return np.unique(windows[hits, -1])


def _nucleus(ids: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Smallest set of most likely tokens whose mass reaches top_p."""
    m = len(probs)
    if m > NUCLEUS_PREFILTER:
        part = np.argpartition(probs, m - NUCLEUS_PREFILTER)[m - NUCLEUS_PREFILTER:]
        if probs[part].sum() < top_p:  # the prefilter does not hold enough mass: sort everything
            part = np.arange(m)
    else:
        part = np.arange(m)
    order = part[np.argsort(-probs[part], kind="stable")]
    cum = np.cumsum(probs[order])
    keep = int(np.searchsorted(cum, top_p) + 1)
    chosen = order[:keep]
    return ids[chosen], probs[chosen]

"""Turning logits into the next token: repetition penalty, temperature, top-k, top-p, min-p, seed.

Same seed + same logits -> same tokens. Greedy (temperature 0) is a plain argmax.
"""
from __future__ import annotations

import numpy as np

from engine.params import SamplingParams

PENALTY_WINDOW = 64  # recent tokens the repetition penalty looks at (llama.cpp's default)
NUCLEUS_PREFILTER = 4096  # candidates sorted before falling back to sorting the whole vocabulary


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    def sample(self, logits: np.ndarray, recent: list[int]) -> int:
        logits = self.penalized(logits, recent)
        if self.greedy:
            return int(np.argmax(logits))
        ids, probs = self._distribution(logits)
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def penalized(self, logits: np.ndarray, recent: list[int]) -> np.ndarray:
        """The logits after the repetition penalty over `recent` (the same array when there is none)."""
        p = self.params
        if p.repetition_penalty != 1.0 and recent:
            return apply_repetition_penalty(logits, recent[-PENALTY_WINDOW:], p.repetition_penalty)
        return logits

    def distribution(self, logits: np.ndarray, recent: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, their probabilities) that sample() draws from; greedy: the argmax, probability 1.
        Speculative sampling (engine.speculative) accepts or corrects draft tokens against it."""
        logits = self.penalized(logits, recent)
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

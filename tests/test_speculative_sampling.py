"""Speculative sampling keeps the target's output distribution (engine.speculative), tested on a
small vocabulary where the exact distribution of every continuation can be enumerated.

The "models" here are tables of logits indexed by the last two tokens, with the KV contract of
engine.model.Model: a pass at pos0 writes its tokens at positions pos0.. and every logit is
computed from what is written at the positions before it, so a rollback that left a stale token
behind would change the numbers. Everything else - the decoder, the acceptance rule, the residual
draw, prompt lookup, the draft-model proposer, the sampler - is the engine's own code.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

scipy_stats = pytest.importorskip("scipy.stats")

from engine.drafting import DraftModel, PromptLookup  # noqa: E402
from engine.params import SamplingParams  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.speculative import MAX_DRAFT, Decoder, DraftPolicy  # noqa: E402

VOCAB = 3
NEW_TOKENS = 5  # continuations enumerated: VOCAB ** NEW_TOKENS cells
PROMPT = [0, 1, 2, 0, 1, 1, 2, 0]
EAGER = [0.0] + [1.0] * (MAX_DRAFT + 1)  # every pass costs one token's: guess as much as allowed


class TableModel:
    """Logits = table[token at pos - 1][token at pos], read from the positions written so far."""

    def __init__(self, seed: int, capacity: int = 64, sharpness: float = 1.5):
        rng = np.random.default_rng(seed)
        self.table = (rng.standard_normal((VOCAB + 1, VOCAB, VOCAB)) * sharpness).astype(np.float32)
        self.capacity = capacity
        self.slots: list[int | None] = [None] * capacity
        self.cfg = SimpleNamespace(sliding_window=0)

    def logits_at(self, pos: int) -> np.ndarray:
        prev = self.slots[pos - 1] if pos > 0 else VOCAB
        assert prev is not None and self.slots[pos] is not None, "read a position nobody wrote"
        return self.table[prev, self.slots[pos]]

    def forward_all(self, tokens, pos0: int = 0) -> np.ndarray:
        assert pos0 + len(tokens) <= self.capacity
        for i, t in enumerate(tokens):
            self.slots[pos0 + i] = int(t)
        return np.stack([self.logits_at(pos0 + i) for i in range(len(tokens))])

    def forward(self, tokens, pos0: int) -> np.ndarray:
        return self.forward_all(tokens, pos0)[-1].copy()


def target_probs(logits: np.ndarray, recent: list[int], params: SamplingParams) -> np.ndarray:
    """The distribution plain sampling draws from, written out again here: repetition penalty
    over the recent tokens, frequency and presence penalties over the generated ones (after
    PROMPT), the no-repeat n-gram guard over them, temperature, top-k, then top-p."""
    x = logits.astype(np.float64).copy()
    if params.repetition_penalty != 1.0:
        for t in set(recent[-64:]):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    generated = recent[len(PROMPT):]
    for t in set(generated):
        x[t] -= generated.count(t) * params.frequency_penalty + params.presence_penalty
    n = params.no_repeat_ngram_size
    if n and len(generated) >= n - 1:
        tail = generated[len(generated) - n + 1:]
        for i in range(len(generated) - n + 1):
            if generated[i:i + n - 1] == tail:
                x[generated[i + n - 1]] = -np.inf
    x /= params.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_k:
        p[np.argsort(-p, kind="stable")[params.top_k:]] = 0.0
        p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = int(np.searchsorted(np.cumsum(p[order]), params.top_p) + 1)
        p[order[keep:]] = 0.0
        p /= p.sum()
    return p


def exact_distribution(model: TableModel, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(continuation) for every continuation of NEW_TOKENS tokens, by enumeration."""
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        ctx = list(PROMPT)
        prob = 1.0
        for t in seq:
            prev = ctx[-2] if len(ctx) > 1 else VOCAB
            prob *= target_probs(model.table[prev, ctx[-1]], ctx, params)[t]
            ctx.append(t)
        out[seq] = prob
    return out


def speculative_samples(params: SamplingParams, guesser: str, n: int, seed: int = 0) -> list[tuple[int, ...]]:
    target = TableModel(seed=11)
    draft = DraftModel(TableModel(seed=12), "table") if guesser == "draft" else None
    if draft is not None:
        draft.cost_per_guess = 0.0
    samples = []
    for i in range(n):
        sampler = Sampler(params.model_copy(update={"seed": seed * 1_000_003 + i}), prompt_len=len(PROMPT))
        logits = target.forward(PROMPT, 0)
        proposer = PromptLookup() if draft is None else draft.proposer(sampler)
        decoder = Decoder(target, sampler, list(PROMPT), logits, proposer, DraftPolicy(EAGER))
        out: list[int] = []
        while len(out) < NEW_TOKENS:
            out.extend(decoder.step(NEW_TOKENS - len(out)))
        assert len(out) == NEW_TOKENS
        samples.append(tuple(out))
    return samples


def chi_square_p(samples: list[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> float:
    cells = list(expected)
    counts = {c: 0 for c in cells}
    for s in samples:
        counts[s] += 1
    # cells the distribution cannot produce must not appear at all
    impossible = [c for c in cells if expected[c] == 0.0 and counts[c]]
    assert not impossible, f"sampled continuations of probability 0: {impossible[:5]}"
    live = [c for c in cells if expected[c] > 0]
    f_obs = np.array([counts[c] for c in live], dtype=np.float64)
    f_exp = np.array([expected[c] for c in live]) * len(samples)
    f_exp *= f_obs.sum() / f_exp.sum()
    return float(scipy_stats.chisquare(f_obs, f_exp).pvalue)


CASES = {
    "temperature": SamplingParams(temperature=1.0),
    "top-k, cold": SamplingParams(temperature=0.7, top_k=2),
    "top-p, penalty": SamplingParams(temperature=1.2, top_p=0.8, repetition_penalty=1.3),
    # guesses rejected by the guard alone, and penalties that change as the guesses are judged
    "guard, OpenAI penalties": SamplingParams(temperature=1.0, no_repeat_ngram_size=2, frequency_penalty=0.6,
                                              presence_penalty=0.4),
}


def _cases():
    """Every case with a draft model's guesses (its own distribution q), and prompt lookup's guesses
    (certain ones: q is one token) on the plain and the penalized case; its other cases are marked slow,
    for CI's 20 minutes (`-m slow` runs them)."""
    for guesser in ("prompt_lookup", "draft"):
        for case in CASES:
            slow = guesser == "prompt_lookup" and case in ("top-k, cold", "top-p, penalty")
            yield pytest.param(case, guesser, id=f"{case}-{guesser}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("case,guesser", list(_cases()))
def test_speculative_sampling_keeps_the_target_distribution(case, guesser):
    params = CASES[case]
    expected = exact_distribution(TableModel(seed=11), params)
    samples = speculative_samples(params, guesser, n=12_000)
    p = chi_square_p(samples, expected)
    assert p > 1e-3, f"{case}/{guesser}: continuations do not follow the target distribution (chi-square p = {p:.2e})"


def test_the_chi_square_check_sees_a_wrong_distribution():
    """The check above has the power to fail: samples of the draft model's own distribution (what
    accepting every guess would give) are told apart from the target's."""
    params = CASES["temperature"]
    draft_table = TableModel(seed=12)
    draft_exact = exact_distribution(draft_table, params)
    rng = np.random.default_rng(5)
    cells = list(draft_exact)
    probs = np.array([draft_exact[c] for c in cells])
    samples = [cells[i] for i in rng.choice(len(cells), size=12_000, p=probs / probs.sum())]
    assert chi_square_p(samples, exact_distribution(TableModel(seed=11), params)) < 1e-6


def test_guesses_are_checked_and_some_rejected():
    """The sampled runs above do exercise the rule: guesses are proposed, some kept, some rejected."""
    params = CASES["temperature"]
    target = TableModel(seed=11)
    kept = guessed = 0
    for i in range(200):
        sampler = Sampler(params.model_copy(update={"seed": i}))
        decoder = Decoder(target, sampler, list(PROMPT), target.forward(PROMPT, 0), PromptLookup(),
                          DraftPolicy(EAGER))
        n = 0
        while n < NEW_TOKENS:
            n += len(decoder.step(NEW_TOKENS - n))
        kept += decoder.accepted_tokens
        guessed += decoder.draft_tokens
    assert guessed > 200 and 0 < kept < guessed


def test_greedy_decoder_picks_plain_greedy_tokens_whatever_the_guesses():
    """On the table model, greedy decoding with eager, mostly wrong guesses gives the argmax chain."""
    target = TableModel(seed=3)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    decoder = Decoder(target, Sampler(params), list(PROMPT), target.forward(PROMPT, 0), PromptLookup(),
                      DraftPolicy(EAGER))
    out: list[int] = []
    while len(out) < 30:
        out.extend(decoder.step(30 - len(out)))
    ctx = list(PROMPT)
    for t in out:
        prev = ctx[-2] if len(ctx) > 1 else VOCAB
        assert t == int(np.argmax(target_probs(target.table[prev, ctx[-1]], ctx, params.model_copy(
            update={"temperature": 1.0})))), "greedy picked another token than the argmax"
        ctx.append(t)
    assert decoder.draft_tokens > 0

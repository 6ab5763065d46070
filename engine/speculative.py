"""Speculative decoding: guess the next tokens cheaply, let the model check them all in one pass.

Decode at batch size one is memory-bound: a pass over a few tokens costs far less than as many
one-token passes (2 tokens: 1.0-1.2x one, 16: 3-4x on 2 threads; several tokens run the prefill
kernels). Each round runs the pending token x (decided, its K/V not
yet written) and k guesses d1..dk in one pass at positions P..P+k; row i of its logits is the
model's next-token distribution after d_i (d_0 = x). Guesses are kept while the model agrees:

* greedy: d_i is kept iff plain greedy decoding picks it there (the same sampler on the same logits:
  the forward pass gives every token the same logits bit for bit however tokens are split into
  passes), so the output is plain greedy's, token for token;
* sampling: the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): keep d_i with
  probability min(1, p(d_i) / q(d_i)), else draw from max(0, p - q) normalised, where p is the
  model's distribution (the sampler's, after penalty, temperature, top-k/p, min-p) and q the one the
  guess was drawn from (a point mass for prompt lookup and greedy drafts). Each output token is then
  distributed exactly as the model's own sample.

The first disagreement ends the round with the model's token in its place; if all k are kept, one
more token comes from the last row. So a round yields accepted + 1 tokens for one pass.

Rolling back costs nothing: the K/V written for rejected guesses stays where it is, and those
positions are written again by the next round before any token reads them. On a sliding-window
layer (a ring of S slots, position p in slot p % S, window W) a pass at P..P+k overwrote the slots
of positions up to P+k-S; the next token, at P+a+1 (a guesses kept), reads back to P+a+2-W. So the
rollback is safe when k <= S - W + 1 + a, and the pass itself already needed k <= S - W (its first
token reads back to P+1-W): kv_layout's S = W + MAX_UBATCH - 1 covers every round of up to
MAX_UBATCH tokens. tests/test_speculative.py checks it bit for bit across a ring boundary.

How many guesses per round (DraftPolicy): from the recent acceptance rate alpha, a round of k
guesses yields 1 + alpha + ... + alpha^k tokens on average and costs a pass of k + 1 tokens plus k
draft-model steps; k maximises tokens per unit of time, and k = 0 (plain decoding) wins when
guessing does not pay.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.model import MAX_UBATCH
from engine.sampler import Sampler

MAX_DRAFT = 15  # guesses per round; a round's pass (MAX_DRAFT + 1 tokens) must fit one MAX_UBATCH pass
assert MAX_DRAFT + 1 <= MAX_UBATCH  # the sliding-window rings' slack covers one pass of rolled-back K/V
# Time of a pass over n = 1..MAX_DRAFT + 1 tokens over a one-token pass, until PassTimer has timed
# them (an engine times them at its first speculative requests): SmolLM2 on 2 threads, 500 tokens
# in. Passes of up to 2 tokens take the decode kernels (one read of the weights), more take the
# prefill kernels' tiles of 4 tokens.
DEFAULT_PASS_COSTS = (0.0, 1.0, 1.2, 1.6, 1.7, 1.85, 1.95, 2.4, 2.6, 2.75, 2.9, 3.05, 3.2, 3.45, 3.65, 3.85, 4.05)
TIMED_SIZES = (2, 3, 4, 5, 6, 8, 10, 12, 16)  # pass sizes timed; the others cost what the next larger one does
assert len(DEFAULT_PASS_COSTS) == MAX_DRAFT + 2


class ForwardModel(Protocol):
    """What decoding needs of a model (engine.model.Model)."""

    @property
    def capacity(self) -> int: ...

    def forward(self, tokens: Sequence[int], pos0: int) -> np.ndarray: ...

    def forward_all(self, tokens: Sequence[int], pos0: int = 0) -> np.ndarray: ...


@dataclass
class Draft:
    """Guessed tokens; probs[i] = (ids, probabilities) that tokens[i] was drawn from, or None when
    each guess is certain (prompt lookup, greedy drafts): q is then a point mass. kind: which sort
    of guess this is (prompt lookup: the length of the match), kept apart in the acceptance rates."""

    tokens: list[int]
    probs: list[tuple[np.ndarray, np.ndarray]] | None = None
    kind: int = 0

    def head(self, k: int) -> Draft:
        return Draft(self.tokens[:k], None if self.probs is None else self.probs[:k], self.kind)


class Proposer(Protocol):
    """Guesses up to k tokens that follow `context` (prompt + tokens decided so far)."""

    cost_per_guess: float  # time of one guess / time of the model's one-token pass
    free: bool  # guessing costs nothing: propose as many as allowed, then choose how many to check
    prior_alpha: float  # the acceptance rate assumed before any guess was checked

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Draft: ...


class DraftPolicy:
    """Guesses per round from the recent acceptance rate and the cost of passes.

    alpha (per kind of guess) is the decayed maximum-likelihood estimate of the chance that a guess
    is kept given the ones before it were: kept guesses / (kept + first rejections), starting from
    prior_alpha (worth two guesses).
    pass_cost[n] is the time of an n-token pass over a one-token pass (pass_cost[0] unused)."""

    DECAY = 0.9  # per round with guesses: about the last ten rounds count
    # Rounds without guesses before one guess is tried again (the rate may have changed); doubled
    # after each try that does not bring guessing back (a draft model catching up costs a pass).
    PROBE_EVERY = 32
    PROBE_MAX = 1024

    def __init__(self, pass_cost: Sequence[float], cost_per_guess: float = 0.0, max_draft: int = MAX_DRAFT,
                 prior_alpha: float = 0.5):
        if len(pass_cost) < 2:
            raise ValueError("pass_cost needs the cost of 1-token passes at least")
        self.pass_cost = list(pass_cost)
        self.cost_per_guess = cost_per_guess
        self.max_draft = min(max_draft, len(self.pass_cost) - 2, MAX_DRAFT)
        self._prior = (2.0 * prior_alpha, 2.0 * (1.0 - prior_alpha))
        self._counts: dict[int, list[float]] = {}  # kind -> [kept, rejected] (decayed)
        self._idle: dict[int, int] = {}  # kind -> rounds without guesses since the last guess
        self._gap: dict[int, int] = {}  # kind -> rounds without guesses before the next try

    def alpha(self, kind: int = 0) -> float:
        kept, rejected = self._counts.get(kind, self._prior)
        return kept / (kept + rejected)

    def expected_speedup(self, k: int, kind: int = 0) -> float:
        """Tokens per unit of time with k guesses per round, over plain decoding's."""
        a = self.alpha(kind)
        tokens = sum(a ** i for i in range(k + 1))
        return tokens / (self.pass_cost[k + 1] / self.pass_cost[1] + k * self.cost_per_guess)

    def draft_length(self, limit: int, kind: int = 0) -> int:
        """Guesses to check in the next round, at most `limit`."""
        if limit <= 0:
            # nothing to guess from this round (prompt lookup found no match): a round without guesses
            # all the same, so a lookup whose matches come and go still gets its probe
            self._idle[kind] = self._idle.get(kind, 0) + 1
            return 0
        best_k, best = 0, 1.0
        for k in range(1, min(limit, self.max_draft) + 1):
            gain = self.expected_speedup(k, kind)
            if gain > best:
                best_k, best = k, gain
        if best_k > 0 or not self._could_pay(limit):
            self._idle[kind] = 0
            if best_k > 0:
                self._gap[kind] = self.PROBE_EVERY
            return best_k
        idle = self._idle.get(kind, 0) + 1
        gap = self._gap.get(kind, self.PROBE_EVERY)
        if idle < gap:
            self._idle[kind] = idle
            return 0
        self._idle[kind] = 0
        self._gap[kind] = min(2 * gap, self.PROBE_MAX)
        return 1

    def _could_pay(self, limit: int) -> bool:
        """Whether guessing could beat plain decoding even if every guess were kept (a draft model
        as costly as the model never can: then it is not even tried)."""
        return any((k + 1) / (self.pass_cost[k + 1] / self.pass_cost[1] + k * self.cost_per_guess) > 1.0
                   for k in range(1, min(limit, self.max_draft) + 1))

    def record(self, guessed: int, kept: int, kind: int = 0) -> None:
        if guessed:
            counts = self._counts.setdefault(kind, list(self._prior))
            counts[0] = counts[0] * self.DECAY + kept
            counts[1] = counts[1] * self.DECAY + (kept < guessed)


class PassTimer:
    """The cost of passes of n = 1..MAX_DRAFT + 1 tokens over a one-token pass, and of a draft model's
    one-token pass over the model's, from timings spread over the first REPEATS speculative requests.

    Each timing is the ratio of a pass to a one-token pass timed right before it, and a cost is the
    median over requests: other load on a shared machine comes in bursts that shift both passes of a
    pair alike, and one burst, even a long one, spoils one request's timings only. Sizes not timed
    (TIMED_SIZES) take the next larger size's cost, and a pass never costs less than a smaller one."""

    REPEATS = 7

    def __init__(self) -> None:
        self.sizes = [n for n in TIMED_SIZES if n <= MAX_DRAFT + 1]
        self.ratios: dict[int, list[float]] = {n: [] for n in self.sizes}
        self.steps: list[float] = []

    @property
    def done(self) -> bool:
        return len(self.ratios[self.sizes[0]]) >= self.REPEATS

    def time_once(self, model: ForwardModel, pos0: int, draft: ForwardModel | None = None) -> None:
        """One timing of every size (and of a draft step), at positions pos0.. (which it writes)."""
        clock = time.perf_counter
        for n in self.sizes:
            t0 = clock()
            model.forward([0], pos0)
            t1 = clock()
            model.forward_all([0] * n, pos0)
            self.ratios[n].append((clock() - t1) / (t1 - t0))
        if draft is not None:
            t0 = clock()
            model.forward([0], pos0)
            t1 = clock()
            draft.forward([0], pos0)
            self.steps.append((clock() - t1) / (t1 - t0))

    def costs(self) -> list[float] | None:
        """[_, 1, cost(2), ..., cost(MAX_DRAFT + 1)], or None before any timing."""
        if not self.ratios[self.sizes[0]]:
            return None
        timed = {n: statistics.median(r) for n, r in self.ratios.items()}
        costs = [0.0, 1.0]
        for n in range(2, MAX_DRAFT + 2):
            costs.append(max(costs[-1], timed[min(m for m in self.sizes if m >= n)]))
        return costs

    def draft_step(self) -> float | None:
        return statistics.median(self.steps) if self.steps else None


def verify(sampler: Sampler, rows: np.ndarray, draft: Draft, context: list[int]) -> tuple[int, int]:
    """(guesses kept, the token that follows them) for the logits `rows` of a pass over the pending
    token and draft.tokens; context ends with the pending token."""
    guesses = draft.tokens
    for i, guess in enumerate(guesses):
        # the history plain decoding would have at this position: penalties and the n-gram guard
        # then decide exactly as they would there
        if sampler.greedy:
            token = sampler.sample(rows[i], context, guesses[:i])
            if token != guess:
                return i, token
            continue
        ids, probs = sampler.distribution(rows[i], context, guesses[:i])
        p = float(probs[ids == guess].sum())
        q_dist = None if draft.probs is None else draft.probs[i]
        q = 1.0 if q_dist is None else float(q_dist[1][q_dist[0] == guess].sum())
        if sampler.rng.random() * q < p:  # kept with probability min(1, p / q)
            continue
        return i, residual_sample(sampler.rng, ids, probs, guess, q_dist)
    return len(guesses), sampler.sample(rows[len(guesses)], context, guesses)


def residual_sample(rng: np.random.Generator, ids: np.ndarray, probs: np.ndarray, guess: int,
                    q_dist: tuple[np.ndarray, np.ndarray] | None) -> int:
    """A token from max(0, p - q) normalised (q: q_dist, or a point mass on `guess`)."""
    if q_dist is None:
        q_ids, q_probs = np.array([guess]), np.ones(1)
    else:
        q_ids, q_probs = q_dist
    support = np.union1d(ids, q_ids)
    p = np.zeros(len(support))
    q = np.zeros(len(support))
    p[np.searchsorted(support, ids)] = probs
    q[np.searchsorted(support, q_ids)] = q_probs
    rest = np.maximum(p - q, 0.0)
    total = rest.sum()
    if not total > 0:  # only when rounding made p <= q everywhere: p itself is the right answer then
        rest, total = p, p.sum()
    return int(support[rng.choice(len(support), p=rest / total)])


class Decoder:
    """Decides the tokens after a prefill, a round at a time: plain decoding without a proposer,
    speculative rounds with one (each yields the kept guesses and the model's next token).

    context: the prompt ids (extended in place with every decided token); logits: the prefill's
    logits for the first new token. on_decided(logits, token), when given, sees every decided token
    with the logits it was sampled from (engine.logprobs), in order, before the array is reused."""

    def __init__(self, model: ForwardModel, sampler: Sampler, context: list[int], logits: np.ndarray,
                 proposer: Proposer | None = None, policy: DraftPolicy | None = None,
                 on_decided: Callable[[np.ndarray, int], None] | None = None):
        if (proposer is None) != (policy is None):
            raise ValueError("a proposer needs a DraftPolicy and the other way round")
        self.on_decided = on_decided
        self.model = model
        self.sampler = sampler
        self.context = context
        self.proposer = proposer
        self.policy = policy
        self._first_logits: np.ndarray | None = logits
        self.kv_tokens = len(context)  # leading context tokens whose K/V sits in the cache
        self.kv_end = len(context)  # positions written so far (rejected guesses included)
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def step(self, allowed: int) -> list[int]:
        """The next 1..allowed tokens. The caller checks each (EOS, stop strings) and may stop at any."""
        if allowed < 1:
            raise ValueError("step() needs room for at least one token")
        if self._first_logits is not None:
            logits, self._first_logits = self._first_logits, None
            return [self._decide(self.sampler.sample(logits, self.context), logits)]
        pos = len(self.context) - 1  # the pending token's position
        draft = None
        if self.proposer is not None:
            draft = self._draft(min(allowed - 1, self.model.capacity - pos - 1, MAX_DRAFT))
        if not draft or not draft.tokens:
            logits = self.model.forward(self.context[-1:], pos)
            self._written(pos + 1, pos + 1)
            return [self._decide(self.sampler.sample(logits, self.context), logits)]
        guesses = draft.tokens
        rows = self.model.forward_all([self.context[-1], *guesses], pos)
        kept, token = verify(self.sampler, rows, draft, self.context)
        self.policy.record(len(guesses), kept, draft.kind)
        self.draft_tokens += len(guesses)
        self.accepted_tokens += kept
        self._written(pos + 1 + kept, pos + 1 + len(guesses))
        if self.on_decided is not None:
            for i in range(kept):  # row i: the logits a kept guess was checked against
                self.on_decided(rows[i], guesses[i])
        self.context.extend(guesses[:kept])
        return [*guesses[:kept], self._decide(token, rows[kept])]

    def _draft(self, limit: int) -> Draft | None:
        if limit <= 0:
            return None
        if self.proposer.free:  # see what there is, then choose how much of it to check
            draft = self._allowed(self.proposer.propose(self.context, limit, self.sampler))
            return draft.head(self.policy.draft_length(len(draft.tokens), draft.kind))
        k = self.policy.draft_length(limit)
        return self._allowed(self.proposer.propose(self.context, k, self.sampler)) if k > 0 else None

    def _allowed(self, draft: Draft) -> Draft:
        """The draft up to its first guess the sampler's constraint refuses (the model could not pick it)."""
        constraint = self.sampler.constraint
        if constraint is None or not draft.tokens:
            return draft
        return draft.head(constraint.valid_prefix(self.context[self.sampler.prompt_len:], draft.tokens))

    def _decide(self, token: int, logits: np.ndarray) -> int:
        if self.on_decided is not None:
            self.on_decided(logits, token)
        self.context.append(token)
        return token

    def _written(self, valid: int, end: int) -> None:
        self.kv_tokens = valid
        self.kv_end = max(self.kv_end, end)

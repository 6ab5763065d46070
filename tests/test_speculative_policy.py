"""Speculative decoding's draft lengths (DraftPolicy) and prompt-lookup guesses (PromptLookup)."""
from __future__ import annotations

import pytest

from engine.drafting import PromptLookup
from engine.speculative import DEFAULT_PASS_COSTS, MAX_DRAFT, DraftPolicy

FLAT = [0.0] + [1.0] * (MAX_DRAFT + 1)


def test_cheap_passes_and_kept_guesses_give_long_drafts():
    policy = DraftPolicy(DEFAULT_PASS_COSTS)
    for _ in range(30):
        policy.record(8, 8)
    assert policy.alpha() > 0.95
    assert policy.draft_length(MAX_DRAFT) >= 8
    assert policy.draft_length(3) == 3  # never more than allowed


def test_rejected_guesses_fall_back_to_plain_decoding_and_probe_ever_more_rarely():
    policy = DraftPolicy(DEFAULT_PASS_COSTS)
    for _ in range(30):
        policy.record(1, 0)
    assert policy.alpha() < 0.05
    tries = [i for i in range(400) if policy.draft_length(MAX_DRAFT) > 0]
    assert tries == [31, 95, 223]  # after 32 rounds, then 64, then 128 more


def test_rounds_with_nothing_to_guess_from_count_toward_the_probe():
    """Prompt lookup offers guesses only in the rounds where it finds a match. With costs that say
    guessing does not pay at the prior rate (but could), the probe must still come: the rounds
    without a match are rounds without guesses too (they once reset the count, and a lookup whose
    matches come and go never guessed at all)."""
    costs = [0.0] + [1.0 + 0.6 * n for n in range(MAX_DRAFT + 1)]   # k guesses: (2 - 0.5 ** k) / (1 + 0.6 k) < 1
    policy = DraftPolicy(costs)
    assert policy.draft_length(3) == 0 and policy._could_pay(3)
    offered = [3 if i % 3 == 0 else 0 for i in range(1, 200)]           # a match every third round
    tries = [i for i, limit in enumerate(offered, start=2) if policy.draft_length(limit) > 0]
    assert tries and tries[0] <= DraftPolicy.PROBE_EVERY + 3
    assert all(offered[i - 2] > 0 for i in tries)                       # a probe only where there is a guess


def test_a_guesser_as_costly_as_the_model_is_not_used_not_even_tried():
    costly = DraftPolicy(DEFAULT_PASS_COSTS, cost_per_guess=0.9)  # 2 tokens for 1.2 + 0.9: never pays
    assert not any(costly.draft_length(MAX_DRAFT) for _ in range(300))
    assert DraftPolicy(DEFAULT_PASS_COSTS, cost_per_guess=0.05).draft_length(MAX_DRAFT) > 0


def test_kinds_of_guesses_keep_their_own_rates():
    policy = DraftPolicy(FLAT)
    for _ in range(20):
        policy.record(4, 4, kind=3)
        policy.record(4, 0, kind=1)
    assert policy.alpha(3) > 0.9 and policy.alpha(1) < 0.1
    assert policy.draft_length(MAX_DRAFT, kind=3) == MAX_DRAFT  # flat costs: as many as allowed
    assert policy.expected_speedup(1, kind=1) < policy.expected_speedup(1, kind=3)


def test_pass_costs_must_cover_every_draft_length():
    with pytest.raises(ValueError):
        DraftPolicy([0.0])


def test_prompt_lookup_continues_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    draft = lookup.propose(context, 4)
    assert draft.kind == 3 and draft.tokens == [8, 9, 1, 6]  # "5 6 7" at 0..2, not the shorter "6 7" at 6..7
    context += [8, 9, 1, 6, 4]  # the model wrote something else after "1 6"
    draft = lookup.propose(context, 2)
    assert draft.kind == 0 and draft.tokens == []  # 4 never appeared before
    context += [7]
    draft = lookup.propose(context, 3)
    assert draft.kind == 1 and draft.tokens == [8, 9, 1]  # the latest "7" with a follower: position 12


def test_prompt_lookup_never_matches_the_suffix_with_itself():
    lookup = PromptLookup()
    assert lookup.propose([1, 2, 3, 4], 4).tokens == []
    assert lookup.propose([1, 2, 3, 4, 1, 2], 4).tokens == [3, 4, 1, 2]  # runs on into the text it copies


def test_the_prior_acceptance_rate_decides_the_first_rounds():
    gemma_like = [0.0, 1.0, 1.05] + [1.5] * (MAX_DRAFT - 1)
    assert DraftPolicy(gemma_like, cost_per_guess=0.68, prior_alpha=0.5).draft_length(MAX_DRAFT) == 0
    optimistic = DraftPolicy(gemma_like, cost_per_guess=0.68, prior_alpha=0.8)
    assert optimistic.draft_length(MAX_DRAFT) == 1
    for _ in range(10):
        optimistic.record(1, 0)  # a draft that never agrees is dropped after a few rounds
    assert optimistic.draft_length(MAX_DRAFT) == 0

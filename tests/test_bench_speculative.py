"""bench_speculative's lookup ceiling: the best any prompt lookup could do, worked out by hand here."""
from __future__ import annotations

import pytest

from bench.bench_speculative import lookup_ceiling

CHEAP = [0.0, 1.0, 1.1, 1.2] + [1.3] * 13  # pass_cost[n] for n = 1..16 tokens


def test_a_run_copied_from_the_prompt_is_checked_in_one_pass():
    # rounds from 1 decided token: after 9 nothing (9 is new); after 2 the prompt's "3 4" agrees
    # (then "5" does not); the best plan checks "3 4" at once: 1 + 1.2 for 4 tokens
    assert lookup_ceiling([1, 2, 3, 4, 5], [9, 2, 3, 4, 7], CHEAP) == pytest.approx(4 / 2.2)


def test_the_text_so_far_counts_and_the_last_token_is_always_the_models():
    # "1 2 3" again: after the second 1 the earlier "2" agrees; after 2 the earlier "3" would too,
    # but it is the last token, which the model decides itself
    assert lookup_ceiling([5], [1, 2, 3, 1, 2, 3], CHEAP) == pytest.approx(5 / 4.1)


def test_the_prompts_last_token_is_an_occurrence():
    assert lookup_ceiling([7, 9], [9, 9, 9], CHEAP) == pytest.approx(2 / 1.1)


def test_guesses_that_cost_more_than_they_bring_are_not_taken():
    costly = [0.0, 1.0, 2.5] + [9.0] * 14
    assert lookup_ceiling([1, 2, 3, 4, 5], [9, 2, 3, 4, 7], costly) == 1.0


def test_a_paraphrase_has_no_ceiling_above_one():
    assert lookup_ceiling([1, 2, 3, 4], [10, 11, 12, 13], CHEAP) == 1.0

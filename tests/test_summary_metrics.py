"""The benchmark's reference-free summary figures (bench/summary_metrics.py), on made-up cases whose
right answer is known."""
from __future__ import annotations

import pytest

from bench import summary_metrics as m


def test_key_terms_are_the_distinctive_words_of_each_document():
    docs = {
        "redis": "Redis keeps keys in memory. Redis replicas copy keys. The server answers clients quickly.",
        "licence": "The licence grants permission. The licence forbids warranty claims. The server is irrelevant.",
        "bread": "Bakers knead dough. Dough rises overnight. Bakers bake loaves; the server is a waiter.",
    }
    terms = m.key_terms(docs, k=3)
    assert terms["redis"][:2] == ["keys", "redis"]  # twice each and only in this document
    assert set(terms["licence"][:1]) == {"licence"}
    assert "server" not in terms["bread"]  # in every document: not distinctive
    assert set(terms["bread"]) <= {"bakers", "dough", "knead", "rises", "overnight", "bake", "loaves", "waiter"}


def test_key_terms_ignore_links_and_markup():
    docs = {"a": "See https://github.com/x/y and <img src='z'> for the widget. The widget spins. @octocat",
            "b": "Something else entirely, about gadgets."}
    assert m.key_terms(docs, k=3)["a"] == ["widget", "spins"]  # all it has: "see" and "for" are stopwords
    assert m.key_terms({"c": "mask ffff:ffff on eth0", "d": "other"}, k=2)["c"] == ["eth", "mask"]


def test_key_term_recall_matches_stems():
    terms = ["licenses", "copying", "warranty", "patent"]
    assert m.key_term_recall("Each license allows copies; copy freely, no warranty.", terms) == 0.75
    assert m.key_term_recall("", terms) == 0.0
    assert m.stem("processes") == m.stem("process") and m.stem("licenses") == m.stem("license")


def test_repetition_counts_repeated_4grams():
    assert m.repetition("one two three four five six") == 0.0
    looped = "which can be very expensive to create which can be very expensive to create"
    # 11 4-grams, of which "which can be very" .. "expensive to create which"? - every gram of the
    # repeated 7-word phrase occurs twice: 4 distinct grams x 2 = 8 of 11
    assert m.repetition(looped) == pytest.approx(8 / 11)
    assert m.repetition("too short") == 0.0


@pytest.mark.parametrize("summary,truncated,cut", [
    ("It works. Then it stopped.", False, False),
    ("It works. Then it stopp", False, True),
    ('He said "stop."', False, False),
    ("东京很大。", False, False),
    ("- pool size 64\n- retries capped at 3", False, False),  # a list ends without a period
    ("- pool size 64\n- retries capped at", True, True),  # ... unless the model ran out of tokens
    ("", False, True),
    ("Run it:\n```\npip install x\n```", False, False),  # a closed code block
    ("Run it:\n```\npip install x", False, True),
])
def test_cut_off(summary, truncated, cut):
    assert m.cut_off(summary, truncated) is cut


def test_content_words_are_numbers_names_and_odd_capitals():
    words = m.content_words("The Redis server stores 1,000 keys. Dana approved v2.4 and gRPC. It ran.\n- Alice left")
    assert words == ["Redis", "1,000", "v2.4", "gRPC"]  # "The", "Dana", "It", "Alice" open a sentence or item
    assert m.content_words("Then Dana approved it, said Bob.") == ["Dana", "Bob"]


def test_unsupported_finds_invented_names_and_numbers():
    doc = "Redis 7.2 was released in 2023 by the Redis team. It stores 1000 keys."
    share, missing = m.unsupported("The Redis release 7.2 came in 2023, said Dana, with 1,000 keys.", doc)
    assert missing == ["Dana"]
    assert share == pytest.approx(1 / 5)  # Redis, 7.2, 2023, Dana, 1,000
    assert m.unsupported("It stores keys.", doc) == (0.0, [])
    assert m.unsupported("It began in 1790 and 7.", "Telegraphs of the 1790s.")[1] == ["7"]


def test_unsupported_accepts_possessives_and_split_names_but_not_inventions():
    doc = "The telegraph reached Britain first. Ask on StackOverflow. Licensed under the BSD license."
    assert m.unsupported("It changed Britain's commerce.", doc) == (0.0, [])
    assert m.unsupported("Questions go to Stack Overflow.", doc) == (0.0, [])
    assert m.unsupported("It is under the MIT license, see Stack Exchange.", doc)[1] == ["MIT", "Stack", "Exchange"]


@pytest.mark.parametrize("summary,framed", [
    ("The summary provides an overview of the key points.", True),
    ("The code above demonstrates a loop.", True),
    ("This text describes the licence.", True),
    ("The licence lets anyone copy the software.", False),
    ("Redis stores the text of each document in memory.", False),
])
def test_framing(summary, framed):
    assert m.framing(summary) is framed


def test_echo_of_the_prompt():
    instructions = "Summarize the following text in at most {words} words. Keep the key facts, names."
    assert m.echoes("Summarize the following text in at most 96 words. Keep the", instructions)
    assert not m.echoes("The licence lets anyone copy the text in at most a day.", instructions)


def test_corpus_score_averages_and_counts():
    docs = {"a": "Alpha beta gamma delta. Alpha beta.", "b": "Epsilon zeta eta theta. Epsilon zeta."}
    terms = m.key_terms(docs, k=2)
    scores = [m.score_summary("a", "Alpha and beta.", docs["a"], terms["a"]),
              m.score_summary("b", "Epsilon zeta eta theta", docs["b"], terms["b"], truncated=True)]
    total = m.score_corpus(scores)
    assert total.documents == 2 and total.cut_off == 1
    assert total.key_term_recall == pytest.approx((1.0 + 1.0) / 2)
    with pytest.raises(ValueError, match="no summaries"):
        m.score_corpus([])

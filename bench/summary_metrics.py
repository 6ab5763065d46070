"""Reference-free figures for summaries of a corpus (bench/bench_summary_quality.py).

* key-term recall: the share of each document's KEY_TERMS most distinctive words (tf-idf over the
  corpus) that its summary uses; words compared by a crude stem (plural and -ing/-ed endings off);
* repetition: the share of the summary's word 4-grams that occur more than once in it;
* cut off: the summary ends mid-sentence (its last line ends with no . ! ? … 。！？ and is not a list
  item or heading of a summary that was not truncated);
* unsupported: the share of the summary's content words - numbers, capitalised terms not opening a
  sentence, words with capitals or digits inside - that do not occur in the document (0 is the goal;
  a name the document never mentions is invented);
* framing: the summary talks about the text ("This summary...", "The text describes...",
  "The code above...") instead of giving its content;
* echo: the summary repeats the prompt's instructions (a base model continuing the prompt);
* words: the summary's length in words.

Each is a pure function of strings, so tests/test_summary_metrics.py can check it on made-up cases.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KEY_TERMS = 8
NGRAM = 4
_WORD = re.compile(r"[^\W\d_]+(?:['\u2019-][^\W\d_]+)*")
_TOKEN = re.compile(r"[^\W_]+(?:(?:[.'\u2019/-]|(?<=\d),(?=\d))[^\W_]+)*")  # words, numbers (2.4, 1,000), v2.4
_NUMBER = re.compile(r"^\d+(?:[.,]\d+)*$")
_NUMBER_HEAD = re.compile(r"^(\d+(?:\.\d+)*)[a-z]+$")
_SENTENCE_FINAL = re.compile(r"[.!?\u2026\u3002\uff01\uff1f][\"'\u201d\u2019)\]\u300d\u300f\uff09*_`]*$")
_MARKER_ONLY = re.compile(r"\s*(?:[-*+\u2022#>]+|\d{1,3}[.)])")
_LIST_OR_HEADING = re.compile(r"^\s*(?:[-*+\u2022]\s|\d{1,3}[.)]\s|#{1,6}\s)")
_FRAMING = re.compile(
    r"\b(?:th(?:is|e) (?:summary|text|document|passage|article|excerpt|section|chapter|note|notes|code)"
    r" (?:above |below )?(?:provides|describes|discusses|explains|outlines|is about|covers|presents|"
    r"highlights|demonstrates|shows|talks|focuses|summari[sz]es|gives|contains|mentions)"
    r"|the (?:code|text|example) (?:above|below)|here is (?:a|the) summary|in summary, the (?:text|document)"
    r"|the author (?:describes|discusses|explains|writes))\b", re.I)
STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below
between both but by can could did do does doing down during each either else ever every few for from
further had has have having he her here hers herself him himself his how however i if in into is it its
itself just let like may me might more most must my myself no nor not now of off on once only or other
our ours ourselves out over own same shall she should since so some such than that the their theirs them
themselves then there these they this those through thus to too under until up upon us use used uses
using very via was we well were what when where whether which while who whom whose why will with within
without would yet you your yours yourself yourselves one two new get gets also etc may much many make
makes made see""".split())


def words(text: str) -> list[str]:
    """Lower-cased words (letters, inner apostrophes and hyphens), numbers left out."""
    return [w.lower() for w in _WORD.findall(text)]


def stem(word: str) -> str:
    """A crude stem, enough to match "licenses" with "license", "processes" with "process" and
    "copying" with "copy" (both sides of a comparison go through it)."""
    w = word.lower()
    if len(w) <= 3:
        return w
    if w.endswith("ies") and len(w) > 4:
        w = w[:-3] + "y"
    elif w.endswith("ing") and len(w) > 5:
        w = w[:-3]
    elif w.endswith("ed") and len(w) > 4:
        w = w[:-2]
    elif w.endswith("es") and len(w) > 4:
        w = w[:-2]
    elif w.endswith("s") and not w.endswith("ss"):
        w = w[:-1]
    if w.endswith("e") and len(w) > 3:
        w = w[:-1]
    return w


_MARKUP = re.compile(r"https?://\S+|www\.\S+|<[^>\n]{1,300}>|&\w+;|\[!\[[^\]]*\]|@\w[\w-]*")


_RUN = re.compile(r"(.)\1{3}")  # "ffff" of an IPv6 mask, "xxxx" placeholders: not words


def prose(text: str) -> str:
    """`text` without URLs, HTML tags and entities, badge images and @handles: the words a summary
    could use, not the ones of links and markup."""
    return _MARKUP.sub(" ", text)


def key_terms(documents: Mapping[str, str], k: int = KEY_TERMS) -> dict[str, list[str]]:
    """Each document's k most distinctive words: tf-idf over the corpus (stems of its prose(); stopwords
    and words under 3 letters left out; idf = ln((1 + N) / (1 + df)) + 1; ties broken alphabetically).
    A term is reported as its most frequent surface form."""
    stems_of: dict[str, Counter[str]] = {}
    surface: dict[str, dict[str, Counter[str]]] = {}
    for name, text in documents.items():
        counts: Counter[str] = Counter()
        forms: dict[str, Counter[str]] = {}
        for w in words(prose(text)):
            if len(w) < 3 or w in STOPWORDS or _RUN.search(w):
                continue
            s = stem(w)
            counts[s] += 1
            forms.setdefault(s, Counter())[w] += 1
        stems_of[name], surface[name] = counts, forms
    n = len(documents)
    df: Counter[str] = Counter()
    for counts in stems_of.values():
        df.update(counts.keys())
    out = {}
    for name, counts in stems_of.items():
        total = sum(counts.values()) or 1
        scored = sorted(counts, key=lambda s: (-(counts[s] / total) * (math.log((1 + n) / (1 + df[s])) + 1), s))
        out[name] = [surface[name][s].most_common(1)[0][0] for s in scored[:k]]
    return out


def key_term_recall(summary: str, terms: Sequence[str]) -> float:
    """The share of `terms` whose stem is among the summary's word stems."""
    if not terms:
        return 0.0
    have = {stem(w) for w in words(summary)}
    return sum(stem(t) in have for t in terms) / len(terms)


def repetition(summary: str, n: int = NGRAM) -> float:
    """The share of the summary's word n-grams (numbers included) that occur more than once."""
    toks = [t.lower() for t in _TOKEN.findall(summary)]
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    if not grams:
        return 0.0
    counts = Counter(grams)
    return sum(1 for g in grams if counts[g] > 1) / len(grams)


def cut_off(summary: str, truncated: bool = False) -> bool:
    """Whether the summary stops mid-sentence. An empty summary counts as cut off (nothing usable)."""
    text = summary.rstrip()
    if not text:
        return True
    if _SENTENCE_FINAL.search(text):
        return False
    if text.endswith(("```", "~~~")) and text.count(text[-3:]) % 2 == 0:
        return False  # a closed code block is a complete unit
    last_line = text.rsplit("\n", 1)[-1]
    return truncated or not _LIST_OR_HEADING.match(last_line)


def content_words(summary: str) -> list[str]:
    """Numbers, capitalised words that do not open a sentence, line or list item, and words with
    capitals or digits inside ("gRPC", "v2", "HTTP2"): the words a summary cannot make up."""
    out = []
    for line in summary.split("\n"):
        for m in _TOKEN.finditer(line):
            tok = m.group()
            before = line[:m.start()].rstrip(" \t\"'(\u201c\u2018*_")
            opening = not before or before[-1] in ".!?:;\u2026" or _MARKER_ONLY.fullmatch(before) is not None
            if _NUMBER.match(tok) or any(c.isdigit() for c in tok) or any(c.isupper() for c in tok[1:]):
                out.append(tok)
            elif tok[0].isupper() and not opening and tok != "I":
                out.append(tok)
    return out


def unsupported(summary: str, document: str) -> tuple[float, list[str]]:
    """(share of the summary's content words not in the document, those words). Words match case-
    insensitively, numbers as written (thousands separators ignored)."""
    found = content_words(summary)
    if not found:
        return 0.0, []
    doc_tokens = {t.lower().replace(",", "") for t in _TOKEN.findall(document)}
    doc_words = {stem(w) for w in words(document)}
    # a number is supported by the same number with a suffix too: "1790" by "1790s", "4" by "4th"
    doc_numbers = {m.group(1) for t in doc_tokens if (m := _NUMBER_HEAD.match(t))}
    # a name the document writes as one word is supported when the summary splits it: "Stack Overflow"
    # by "StackOverflow" (either half of the pair)
    seq = [t.lower() for t in _TOKEN.findall(summary)]
    joined = {a + b for a, b in zip(seq, seq[1:])} & doc_tokens
    missing = []
    for w in found:
        key = re.sub(r"['\u2019]s$", "", w.lower().replace(",", ""))   # a possessive: "Britain's" by "Britain"
        if key in doc_tokens or key in doc_numbers or (not _NUMBER.match(w) and stem(key) in doc_words):
            continue
        if any(j.startswith(key) or j.endswith(key) for j in joined):
            continue
        missing.append(w)
    return len(missing) / len(found), missing


def framing(summary: str) -> bool:
    """Whether the summary describes the text instead of summarising it."""
    return _FRAMING.search(summary) is not None


def echoes(summary: str, instructions: str, n: int = 6) -> bool:
    """Whether the summary repeats the prompt's own instructions: a word n-gram of `instructions`
    (the template's text without its placeholders) in the summary. A base model that cannot chat
    continues the prompt instead of answering it."""
    def grams(text: str) -> set[tuple[str, ...]]:
        ws = words(text)
        return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}

    return bool(grams(summary) & grams(re.sub(r"\{\w+\}", " ", instructions)))


@dataclass(frozen=True)
class SummaryScore:
    name: str
    key_terms: tuple[str, ...]
    key_term_recall: float
    repetition: float
    cut_off: bool
    unsupported: float
    unsupported_words: tuple[str, ...]
    framing: bool
    words: int
    echo: bool = False


def score_summary(name: str, summary: str, document: str, terms: Sequence[str], truncated: bool = False,
                  instructions: str = "") -> SummaryScore:
    share, missing = unsupported(summary, document)
    return SummaryScore(name=name, key_terms=tuple(terms), key_term_recall=key_term_recall(summary, terms),
                        repetition=repetition(summary), cut_off=cut_off(summary, truncated), unsupported=share,
                        unsupported_words=tuple(missing), framing=framing(summary), words=len(_TOKEN.findall(summary)),
                        echo=bool(instructions) and echoes(summary, instructions))


@dataclass(frozen=True)
class CorpusScore:
    documents: int
    key_term_recall: float  # means over documents
    repetition: float
    cut_off: int  # counts
    unsupported: float
    framing: int
    words: float
    echo: int = 0


def score_corpus(scores: Sequence[SummaryScore]) -> CorpusScore:
    n = len(scores)
    if n == 0:
        raise ValueError("no summaries to score")
    return CorpusScore(documents=n, key_term_recall=sum(s.key_term_recall for s in scores) / n,
                       repetition=sum(s.repetition for s in scores) / n, cut_off=sum(s.cut_off for s in scores),
                       unsupported=sum(s.unsupported for s in scores) / n, framing=sum(s.framing for s in scores),
                       words=sum(s.words for s in scores) / n, echo=sum(s.echo for s in scores))

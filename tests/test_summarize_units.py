"""The summariser's pure parts: templates, input collection, budgets and reduce trees, output.

The end-to-end run with the real model and a real Redis is tests/test_summarize.py.
"""
from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest

from jobs.summary_unit import part_label_pattern, tidy_summary
from pipeline.summarize import (
    Budget,
    Document,
    Progress,
    PromptMeter,
    Skipped,
    SummarizeError,
    Templates,
    collect_documents,
    markdown_report,
    plan_document,
    reduce_fan_in,
    reduce_tree,
    words_for,
)
from pipeline.summarize.templates import document_context
from tests.test_chunking import LONG_DOC, WordPieceTokenizer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def fake_meter() -> PromptMeter:
    tok = WordPieceTokenizer()

    def render(messages):
        return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages) + "<|assistant|>\n"

    return PromptMeter(tok, render)


# --- templates --------------------------------------------------------------------------------

def test_default_templates_put_instructions_before_the_chunk():
    t = Templates.load()
    a = t.map_messages("first chunk text", 50)
    b = t.map_messages("a different chunk", 50)
    assert [m["role"] for m in a] == ["system", "user"]
    # Everything up to the chunk is identical: a cached prompt prefix is shared by all chunks.
    assert a[0] == b[0]
    ua, ub = a[1]["content"], b[1]["content"]
    assert ua.endswith("first chunk text") and ub.endswith("a different chunk")
    assert ua[: -len("first chunk text")] == ub[: -len("a different chunk")]
    assert "50 words" in ua


def test_template_override_and_validation(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('[map]\nuser = "TL;DR of this:\\n{text}"\n')
    t = Templates.load(f)
    assert t.map_user == "TL;DR of this:\n{text}"
    assert t.reduce_user == Templates.load().reduce_user  # untouched keys keep the defaults
    assert t.map_messages("x", 10)[-1]["content"] == "TL;DR of this:\nx"

    j = tmp_path / "t.json"
    j.write_text(json.dumps({"reduce": {"part": "- {summary}"}}))
    assert Templates.load(j).part == "- {summary}"

    bad = tmp_path / "bad.toml"
    bad.write_text('[map]\nuser = "no placeholder"\n')
    with pytest.raises(SummarizeError, match=r"must contain \{text\}"):
        Templates.load(bad)
    bad.write_text('[map]\nusr = "typo {text}"\n')
    with pytest.raises(SummarizeError, match="unknown key"):
        Templates.load(bad)
    bad.write_text("[map\n")
    with pytest.raises(SummarizeError, match="not valid TOML"):
        Templates.load(bad)


def test_reduce_messages_number_the_parts():
    spec = Templates.load().reduce_spec("m", 40)
    msgs = spec.messages(["Alpha happened.", "Beta followed."])
    user = msgs[-1]["content"]
    assert "Part 1: Alpha happened.\n\nPart 2: Beta followed." in user
    assert "40 words" in user


# --- inputs -----------------------------------------------------------------------------------

def test_collect_documents_reports_every_skip(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\nSome text.\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("More text here.")
    (tmp_path / "empty.txt").write_text("  \n\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (tmp_path / "utf16-no-bom.txt").write_bytes("no byte order mark".encode("utf-16-le"))
    (tmp_path / "big.txt").write_text("word " * 1000)
    (tmp_path / ".hidden.md").write_text("not collected")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.md")
    docs, skipped = collect_documents([str(tmp_path), str(tmp_path / "a.md"), str(tmp_path / "missing.md"),
                                       str(tmp_path / "*.none")], max_bytes=2000)
    assert sorted(Path(d.path).name for d in docs) == ["a.md", "b.txt"]  # a.md once, not twice
    reasons = {Path(s.path).name: s.reason for s in skipped}
    assert reasons["empty.txt"] == "empty"
    assert reasons["image.png"].startswith("binary")
    assert reasons["utf16-no-bom.txt"] == "binary (contains NUL bytes)"  # without a mark, NULs mean binary
    assert reasons["big.txt"].startswith("too large")
    assert reasons["dangling.md"].startswith("unreadable")
    assert reasons["missing.md"] == "not found"
    assert reasons["*.none"] == "no file matches this pattern"
    assert ".hidden.md" not in reasons


def test_collect_documents_globs_and_crlf(tmp_path):
    (tmp_path / "x.md").write_bytes(b"line one\r\nline two\r\n")
    (tmp_path / "y.txt").write_text("why")
    docs, skipped = collect_documents([str(tmp_path / "*.md")])
    assert [Path(d.path).name for d in docs] == ["x.md"] and not skipped
    assert docs[0].text == "line one\nline two\n"


# --- budgets and trees ------------------------------------------------------------------------

@pytest.mark.parametrize("n,fan_in,shape", [
    (1, 4, []),
    (2, 4, [[[0, 1]]]),
    (4, 4, [[[0, 1, 2, 3]]]),
    (5, 4, [[[0, 1, 2], [3, 4]], [[0, 1]]]),
    (9, 3, [[[0, 1, 2], [3, 4, 5], [6, 7, 8]], [[0, 1, 2]]]),
    (10, 3, [[[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]], [[0, 1], [2, 3]], [[0, 1]]]),
])
def test_reduce_tree(n, fan_in, shape):
    levels = reduce_tree(n, fan_in)
    assert levels == shape
    width = n
    for groups in levels:
        assert [i for g in groups for i in g] == list(range(width))  # every input once, in order
        assert all(2 <= len(g) <= fan_in for g in groups)
        width = len(groups)


class WordTokenizer:
    """One token per word (with the whitespace before it): counts anyone can check with str.split."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = []
        for piece in re.findall(r"\s*\S+", text):
            self.pieces.append(piece)
            ids.append(len(self.pieces) - 1)
        return ids

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


# Templates whose prompts are just their parts: a map prompt is "Document: <title>" and the chunk, a
# reduce prompt the summaries joined by spaces.
BARE = Templates(map_system="", map_user="{context}{text}", reduce_system="", reduce_user="{text}",
                 part="{summary}", separator=" ")


def word_meter() -> PromptMeter:
    return PromptMeter(WordTokenizer(), lambda messages: " ".join(m["content"] for m in messages))


def test_fan_in_and_prompt_sizes_against_hand_worked_numbers():
    meter = word_meter()
    budget = Budget(capacity=100, max_summary_tokens=10, overlap_tokens=0)
    # 100 tokens - 10 for the reply - 4 of margin leave 86 for a prompt: eight summaries of 10 words
    # (80) fit, nine (90) do not.
    assert reduce_fan_in(meter, BARE, budget, words_for(10)) == 8
    assert reduce_fan_in(meter, BARE, Budget(capacity=50, max_summary_tokens=10), words_for(10)) == 3  # 36: 30 fit

    paragraphs = [" ".join(f"w{p}x{i}" for i in range(10)) + "." for p in range(100)]  # 1,000 words
    doc = Document("notes.txt", "\n\n".join(paragraphs), 0)
    plan = plan_document(0, doc, run_id="abc", model="m", meter=meter, templates=BARE, budget=budget, fan_in=8)
    # each prompt is "Document: notes" (2 words) and its chunk, within the 86 tokens
    assert plan.prompt_tokens == [2 + len(c.text.split()) for c in plan.chunks]
    assert all(n <= 86 for n in plan.prompt_tokens)
    assert sum(len(c.text.split()) for c in plan.chunks) == 1000  # no overlap: every word once
    assert len(plan.chunks) >= 1000 // 84
    # more than 8 chunks: a first level of reduces of at most 8, then one over them
    assert plan.levels == 2
    level1 = [r for r in plan.reduces if r.level == 1]
    assert [i for r in level1 for i in r.inputs] == plan.map_ids and all(2 <= len(r.inputs) <= 8 for r in level1)
    assert [r.inputs for r in plan.reduces if r.level == 2] == [[r.job_id for r in level1]]


def test_plan_with_the_built_in_templates_keeps_prompts_in_the_budget():
    meter = fake_meter()
    t = Templates.load()
    budget = Budget(capacity=400, max_summary_tokens=60, overlap_tokens=16)
    fan_in = reduce_fan_in(meter, t, budget, words_for(budget.max_summary_tokens))
    plan = plan_document(0, Document("long.md", LONG_DOC, len(LONG_DOC)), run_id="abc", model="m", meter=meter,
                         templates=t, budget=budget, fan_in=fan_in)
    assert len(plan.chunks) > fan_in >= 2  # so the reduce needs more than one level
    for msgs, chunk in zip(plan.map_messages, plan.chunks):
        assert chunk.text in msgs[-1]["content"]
        assert len(meter.tokenizer.encode(meter.render_chat(msgs))) + budget.max_summary_tokens <= budget.capacity
    assert any("Section: " in m[-1]["content"] for m in plan.map_messages)
    assert plan.levels >= 2
    assert plan.final_id == plan.reduces[-1].job_id
    covered = [i for r in plan.reduces if r.level == 1 for i in r.inputs]
    assert covered == plan.map_ids
    assert all(len(r.inputs) <= fan_in for r in plan.reduces)
    assert len(set(plan.job_ids)) == len(plan.job_ids)


def test_budget_too_small_is_explained():
    meter = fake_meter()
    with pytest.raises(SummarizeError, match="kv-budget"):
        reduce_fan_in(meter, Templates.load(), Budget(capacity=150, max_summary_tokens=60), 36)


def test_fit_summaries_truncates_the_longest():
    meter = fake_meter()
    spec = Templates.load().reduce_spec("m", 30)
    summaries = ["short one.", "long " * 300, "another short one."]
    base = meter.count(spec.messages(summaries))
    out = spec.fit(summaries, meter.count, capacity=base - 100, max_tokens=20, tokenizer=meter.tokenizer)
    assert out[0] == summaries[0] and out[2] == summaries[2]
    assert meter.count(spec.messages(out)) + 20 <= base - 100


# --- output -----------------------------------------------------------------------------------

def test_tidy_summary():
    assert tidy_summary("Summary: The plan works.", "stop") == "The plan works."
    assert tidy_summary("Here is a short summary of the text: It works.", "stop") == "It works."
    assert tidy_summary("The summary is:\n\nDana shipped 2.4.", "stop") == "Dana shipped 2.4."
    assert tidy_summary("**Summary:** It works.", "stop") == "It works."
    # Only a lead-in label goes; a colon later in the text stays.
    assert tidy_summary("Decisions: the pool stays at 64.", "stop") == "Decisions: the pool stays at 64."
    assert tidy_summary("One sentence done. Another one that got cu", "length") == "One sentence done."
    assert tidy_summary("No sentence end at all", "length") == "No sentence end at all"
    assert tidy_summary("See e.g. the manual for the steps. Then run it wi", "length") == \
           "See e.g. the manual for the steps."
    assert tidy_summary("東京は大きい。人が多い。まだ", "length") == "東京は大きい。人が多い。"
    assert tidy_summary("- pool size is 64\n- retries are capped at 3\n- the cach", "length") == \
           "- pool size is 64\n- retries are capped at 3"


def test_tidy_summary_drops_lines_that_are_only_images():
    badge = "[![Build status](https://github.com/rq/rq/workflows/Test/badge.svg)](https://github.com/rq/rq/actions)"
    text = f"RQ queues jobs in Redis.\n\nRQ requires Redis >= 5.\n\n{badge} ![logo](logo.png)\n"
    assert tidy_summary(text, "stop") == "RQ queues jobs in Redis.\n\nRQ requires Redis >= 5."
    # An image inside a line of text is the model's sentence: kept, as is a plain link.
    kept = "See ![the diagram](d.png) for the flow.\n[Docs](https://python-rq.org) explain it."
    assert tidy_summary(kept, "stop") == kept


def test_part_labels_copied_by_the_model_are_removed():
    pat = part_label_pattern(Templates.load().part)
    text = "Part 1: The plan works.\n\nPart 2: It ships in May. Part 3 is later."
    assert pat.sub("", text) == "The plan works.\n\nIt ships in May. Part 3 is later."
    assert part_label_pattern("- {summary}") is None
    assert part_label_pattern("[{n}] {summary}").sub("", "[2] Done.") == "Done."


def _report_records():
    return [
        {"path": "docs/a.md", "title": "Alpha <plan>", "sections": ["Goals", "Risks & costs"],
         "summary": "A ships in May.", "chunks": 1, "reduce_levels": 0, "tokens_in": 120, "tokens_out": 20,
         "seconds": 1.5},
        {"path": "b.md", "title": "b", "sections": [], "summary": None, "error": "job x failed: boom", "chunks": 3,
         "reduce_levels": 1, "tokens_in": 0, "tokens_out": 0, "seconds": 2.0},
    ]


SETTINGS = {"model": "smollm2-135m", "style": "bullets", "max summary tokens": 160}


def test_markdown_report_gives_titles_sections_totals_and_settings():
    md = markdown_report(_report_records(), [Skipped("c.bin", "binary (contains NUL bytes)")], settings=SETTINGS,
                         wall_seconds=3.0)
    assert md.startswith("# Summaries")
    assert "## Alpha <plan>\n\n`docs/a.md`\n\nA ships in May." in md
    assert "Sections: Goals · Risks & costs" in md
    assert "1 chunk · 120 tokens in, 20 out · 1.5 s" in md
    assert "model: smollm2-135m · style: bullets · max summary tokens: 160" in md
    assert "- `b.md`: job x failed: boom" in md
    assert "- `c.bin`: binary (contains NUL bytes)" in md
    assert "1 document summarised, 1 failed, 1 skipped in 3.0 s; 120 tokens in, 20 out." in md


def test_html_report_escapes_every_text():
    from pipeline.summarize import html_report
    from html.parser import HTMLParser

    page = html_report(_report_records(), [Skipped("<c>.bin", "binary")], settings=SETTINGS, wall_seconds=3.0)
    assert "<h2>Alpha &lt;plan&gt;</h2>" in page and "Risks &amp; costs" in page
    assert "<code>&lt;c&gt;.bin</code>: binary" in page and "job x failed: boom" in page
    assert "<plan>" not in page

    class Tags(HTMLParser):
        def __init__(self):
            super().__init__()
            self.open: list[str] = []

        def handle_starttag(self, tag, attrs):
            if tag not in ("meta", "br", "!doctype"):
                self.open.append(tag)

        def handle_endtag(self, tag):
            assert self.open and self.open[-1] == tag, (tag, self.open)
            self.open.pop()

    t = Tags()
    t.feed(page)
    assert t.open == []  # every element closed, in order


def test_styles_fill_the_prompts_and_unknown_ones_are_named():
    from pipeline.summarize import STYLES, document_context

    for style, sentence in STYLES.items():
        t = Templates.load(style=style)
        user = t.map_messages("Body text.", 40, document_context("Alpha", ("Alpha", "Goals", "Q3")))[-1]["content"]
        assert sentence in user and "{" not in user
        assert user.index("at most 40 words") < user.index("Document: Alpha\nSection: Goals > Q3\nText:\nBody text.")
        spec = t.reduce_spec("m", 40, document_context("Alpha"))
        assert sentence in spec.user and "Document: Alpha\n" in spec.user and "{text}" in spec.user
    assert len(set(STYLES.values())) == len(STYLES)
    with pytest.raises(SummarizeError, match="unknown style 'prose'; choose one of: paragraph, bullets"):
        Templates.load(style="prose")


def test_map_prompts_share_the_instructions_as_a_prefix():
    from pipeline.summarize import document_context

    t = Templates.load()
    a = t.map_messages("first chunk", 40, document_context("A", ("A", "One")))[-1]["content"]
    b = t.map_messages("other chunk", 40, document_context("B"))[-1]["content"]
    shared = a[:a.index("Document:")]
    assert b.startswith(shared) and "Reply with the summary only." in shared
    assert document_context("") == "" and document_context("T", ("T",)) == "Document: T\n"


def test_a_document_is_titled_by_its_opening_heading_else_its_file_name():
    from pipeline.structure import outline
    from pipeline.summarize.plan import document_title

    def title(path, text):
        return document_title(Document(path, text, len(text)), outline(text))

    assert title("x/notes.md", "# Release plan\n\nWe ship.\n\n## Risks\n\nFew.\n") == "Release plan"
    assert title("x/notes.md", "We ship in May, as agreed.\n") == "notes"
    assert title("x/notes.md", "word " * 200 + "\n\n# Late heading\n\nText.\n") == "notes"
    assert title("LICENSE", "no headings here\n") == "LICENSE"
    assert title(".profile", "x\n") == ".profile"


def test_progress_plain_lines_when_not_a_terminal():
    buf = io.StringIO()
    p = Progress(3, 10, stream=buf)
    p.update(0, 0, force=True)
    p.update(0, 0)
    p.update(1, 4)
    p.update(3, 10)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    assert "documents 3/3" in lines[-1] and "chunks 10/10" in lines[-1]
    assert "[########################]" in lines[-1]


def test_chunks_stay_within_chunk_tokens_when_the_kv_budget_is_large():
    meter = fake_meter()
    t = Templates.load()
    words = words_for(60)
    doc = Document("long.md", LONG_DOC, len(LONG_DOC))
    roomy = Budget(capacity=100_000, max_summary_tokens=60, overlap_tokens=16, chunk_tokens=1 << 20)
    whole = plan_document(0, doc, run_id="a", model="m", meter=meter, templates=t, budget=roomy, fan_in=8)
    capped = Budget(capacity=100_000, max_summary_tokens=60, overlap_tokens=16, chunk_tokens=64)
    plan = plan_document(0, doc, run_id="b", model="m", meter=meter, templates=t, budget=capped, fan_in=8)
    assert len(whole.chunks) == 1  # the budget alone would take the document in one prompt
    assert len(plan.chunks) > 2
    assert all(n <= meter.count(t.map_messages("", words, document_context(plan.title, c.section_path))) + 64
               for n, c in zip(plan.prompt_tokens, plan.chunks))

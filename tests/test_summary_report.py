"""The summarise report (pipeline.summarize.report), rendered from its Jinja2 templates: the Markdown
and HTML pages as a reader gets them, and the progress bar's plain lines, against hand-written text."""
from __future__ import annotations

import io

from pipeline.summarize.documents import Skipped
from pipeline.summarize.report import Progress, html_report, markdown_report

RECORDS = [
    {"path": "a.md", "title": "A <&>", "summary": " It ships.\n", "sections": ["Plan", "Risks"], "chunks": 2,
     "reduce_levels": 1, "tokens_in": 1200, "tokens_out": 40, "seconds": 3.25},
    {"path": "b.md", "error": "worker_error: boom", "chunks": 1, "reduce_levels": 0, "tokens_in": 0,
     "tokens_out": 0, "seconds": 0},
]
SKIPPED = [Skipped("c.bin", "binary")]


def test_the_markdown_report():
    assert markdown_report(RECORDS, SKIPPED, settings={"model": "m"}, wall_seconds=4.0) == """\
# Summaries

1 document summarised, 1 failed, 1 skipped in 4.0 s; 1,200 tokens in, 40 out.

_model: m_

## A <&>

`a.md`

It ships.

Sections: Plan · Risks

_2 chunks, 1 reduce level · 1,200 tokens in, 40 out · 3.2 s_

## Failed

- `b.md`: worker_error: boom

## Skipped

- `c.bin`: binary
"""


def test_the_html_report_escapes_every_text():
    page = html_report(RECORDS, SKIPPED, settings={"model": "m & <n>"}, wall_seconds=4.0)
    body = page[page.index("<h1>"):]
    assert body == """\
<h1>Summaries</h1>
<p>1 document summarised, 1 failed, 1 skipped in 4.0 s; 1,200 tokens in, 40 out.</p>
<p class="meta">model: m &amp; &lt;n&gt;</p>
<section><h2>A &lt;&amp;&gt;</h2>
<p class="meta"><code>a.md</code></p>
<div class="summary">It ships.</div>
<p class="meta">Sections: Plan · Risks</p>
<p class="meta">2 chunks, 1 reduce level · 1,200 tokens in, 40 out · 3.2 s</p>
</section>
<h2>Failed</h2>
<ul>
<li><code>b.md</code>: worker_error: boom</li>
</ul>
<h2>Skipped</h2>
<ul>
<li><code>c.bin</code>: binary</li>
</ul>
</body></html>
"""
    assert page.startswith("<!doctype html>\n<html lang=\"en\">")


def test_an_empty_run_has_no_failed_or_skipped_sections():
    text = markdown_report([], [], settings={"model": "m"}, wall_seconds=0.0)
    assert text == "# Summaries\n\n0 documents summarised in 0.0 s; 0 tokens in, 0 out.\n\n_model: m_\n"


def test_progress_draws_a_tqdm_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    p = Progress(2, 6, stream=out)
    p.update(0, 3, force=True)  # 3 of 8 steps: 9 of 24 marks
    p.message("failed x.md: boom")
    p.update(2, 6, 1, force=True)
    p.close()
    text = out.getvalue()
    assert "[#########...............] documents 0/2  chunks 3/6" in text
    assert "failed x.md: boom\n" in text
    assert text.rstrip("\n").rsplit("\r", 1)[-1].startswith("[########################] documents 2/2  chunks 6/6")
    assert text.rstrip("\n").endswith("(1 failed)") and text.endswith("\n")

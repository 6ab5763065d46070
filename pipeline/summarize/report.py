"""What the user sees: a live progress line on stderr, a JSONL line per document as it finishes or a
Markdown or HTML report at the end, and the run's totals."""
from __future__ import annotations

import html
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from pipeline.summarize.documents import Skipped


class Progress:
    """One live line on stderr: documents and chunks done. Plain lines when stderr is not a terminal."""

    def __init__(self, total_docs: int, total_chunks: int, stream: IO[str] | None = None, width: int = 24):
        self.total_docs = total_docs
        self.total_chunks = total_chunks
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.width = width
        self.t0 = time.monotonic()
        self._last: tuple[int, int, int] | None = None
        self._last_draw = 0.0

    def line(self, docs: int, chunks: int, failed: int) -> str:
        frac = (chunks + docs) / max(1, self.total_chunks + self.total_docs)
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        text = (f"[{bar}] documents {docs}/{self.total_docs}  chunks {chunks}/{self.total_chunks}"
                f"  {time.monotonic() - self.t0:6.1f}s")
        if failed:
            text += f"  ({failed} failed)"
        return text

    def update(self, docs: int, chunks: int, failed: int = 0, *, force: bool = False) -> None:
        state = (docs, chunks, failed)
        now = time.monotonic()
        if self.tty:
            if state == self._last and not force and now - self._last_draw < 0.5:
                return
            self.stream.write("\r\x1b[2K" + self.line(docs, chunks, failed))
        else:
            # A log, not a screen: a line when a document ends, otherwise at most one a second.
            if not force and (state == self._last or (
                    self._last is not None and state[0::2] == self._last[0::2] and now - self._last_draw < 1.0)):
                return
            self.stream.write(self.line(docs, chunks, failed) + "\n")
        self.stream.flush()
        self._last, self._last_draw = state, now

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """A line above the bar (the bar is redrawn by the next update)."""
        if self.tty:
            self.stream.write("\r\x1b[2K")
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last = None


FORMATS = ("jsonl", "md", "html")


class Output:
    """JSONL: a line per document as it finishes. Markdown or HTML: a report written at the end."""

    def __init__(self, stream: IO[str], fmt: str, *, model: str, settings: dict[str, Any] | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.stream = stream
        self.fmt = fmt
        self.settings = settings or {"model": model}
        self.records: list[tuple[int, dict[str, Any]]] = []

    def add(self, index: int, record: dict[str, Any]) -> None:
        self.records.append((index, record))
        if self.fmt == "jsonl":
            self.stream.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.stream.flush()

    def finish(self, skipped: Sequence[Skipped], *, wall_seconds: float) -> None:
        if self.fmt == "jsonl":
            return
        records = [r for _, r in sorted(self.records, key=lambda x: x[0])]
        render = markdown_report if self.fmt == "md" else html_report
        self.stream.write(render(records, skipped, settings=self.settings, wall_seconds=wall_seconds))
        self.stream.flush()


def _totals(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], wall_seconds: float) -> str:
    ok = sum(1 for r in records if not r.get("error"))
    failed = len(records) - ok
    tokens_in = sum(r.get("tokens_in", 0) for r in records)
    tokens_out = sum(r.get("tokens_out", 0) for r in records)
    return (f"{ok} document{'s' if ok != 1 else ''} summarised" + (f", {failed} failed" if failed else "")
            + (f", {len(skipped)} skipped" if skipped else "")
            + f" in {wall_seconds:.1f} s; {tokens_in:,} tokens in, {tokens_out:,} out.")


def _detail(r: dict[str, Any]) -> str:
    return (f"{r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}"
            + (f", {r['reduce_levels']} reduce level{'s' if r['reduce_levels'] != 1 else ''}" if r["reduce_levels"] else "")
            + f" · {r['tokens_in']:,} tokens in, {r['tokens_out']:,} out · {r['seconds']:.1f} s"
            + (f" · {r['encoding_note']}" if r.get("encoding_note") else ""))


def _settings_line(settings: dict[str, Any]) -> str:
    return " · ".join(f"{k}: {v}" for k, v in settings.items())


def markdown_report(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *, settings: dict[str, Any],
                    wall_seconds: float) -> str:
    """Each document's title, file, summary and section list, its time and tokens; the run's totals
    and the settings it ran with."""
    lines = ["# Summaries", "", _totals(records, skipped, wall_seconds), "", f"_{_settings_line(settings)}_", ""]
    for r in records:
        if r.get("error"):
            continue
        lines += [f"## {r.get('title') or r['path']}", "", f"`{r['path']}`", "",
                  (r.get("summary") or "_(empty summary)_").strip(), ""]
        if r.get("sections"):
            lines += ["Sections: " + " · ".join(r["sections"]), ""]
        lines += [f"_{_detail(r)}_", ""]
    return "\n".join(lines + _failed_and_skipped_md(records, skipped))


def _failed_and_skipped_md(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped]) -> list[str]:
    lines: list[str] = []
    failed = [r for r in records if r.get("error")]
    if failed:
        lines += ["## Failed", ""] + [f"- `{r['path']}`: {r['error']}" for r in failed] + [""]
    if skipped:
        lines += ["## Skipped", ""] + [f"- `{s.path}`: {s.reason}" for s in skipped] + [""]
    return lines


def html_report(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *, settings: dict[str, Any],
                wall_seconds: float) -> str:
    """The Markdown report's content as one self-contained HTML page (every text escaped)."""
    e = html.escape
    parts = _html_head("Summaries", _totals(records, skipped, wall_seconds), settings)
    for r in records:
        if r.get("error"):
            continue
        parts += [f"<section><h2>{e(r.get('title') or r['path'])}</h2>", f'<p class="meta"><code>{e(r["path"])}</code></p>',
                  f'<div class="summary">{e((r.get("summary") or "(empty summary)").strip())}</div>']
        if r.get("sections"):
            parts.append('<p class="meta">Sections: ' + " · ".join(e(t) for t in r["sections"]) + "</p>")
        parts += [f'<p class="meta">{e(_detail(r))}</p>', "</section>"]
    return _html_page(parts, records, skipped)


def _html_head(title: str, totals: str, settings: dict[str, Any]) -> list[str]:
    e = html.escape
    return ["<!doctype html>", f'<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>',
            "<style>body{font-family:system-ui,sans-serif;max-width:50rem;margin:2rem auto;padding:0 1rem;"
            "line-height:1.5}.meta{color:#555;font-size:.9em}.summary{white-space:pre-wrap}</style></head><body>",
            f"<h1>{e(title)}</h1>", f"<p>{e(totals)}</p>", f'<p class="meta">{e(_settings_line(settings))}</p>']


def _html_page(parts: list[str], records: Sequence[dict[str, Any]], skipped: Sequence[Skipped]) -> str:
    """The page: `parts` (from _html_head on), then the Failed and Skipped lists."""
    e = html.escape
    failed = [r for r in records if r.get("error")]
    for heading, items in (("Failed", [(r["path"], r["error"]) for r in failed]),
                           ("Skipped", [(s.path, s.reason) for s in skipped])):
        if items:
            parts += [f"<h2>{heading}</h2>", "<ul>"] + [f"<li><code>{e(p)}</code>: {e(w)}</li>" for p, w in items] + ["</ul>"]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# rqllm extract's report: the same page with each document's object (pipeline.extract's records)

def _extraction_totals(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], wall_seconds: float) -> str:
    ok = sum(1 for r in records if not r.get("error"))
    failed = len(records) - ok
    chunks = sum(r.get("chunks", 1) for r in records)
    return (f"{ok} object{'s' if ok != 1 else ''} extracted" + (f", {failed} failed" if failed else "")
            + (f", {len(skipped)} skipped" if skipped else "")
            + f" in {wall_seconds:.1f} s; {chunks} chunk{'s' if chunks != 1 else ''}; "
            + f"{sum(r.get('tokens_in', 0) for r in records):,} tokens in, "
            + f"{sum(r.get('tokens_out', 0) for r in records):,} out.")


def _extraction_detail(r: dict[str, Any]) -> str:
    merged = ", merged" if r["chunks"] > 1 else ""
    return (f"{r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}{merged}"
            f" · {r['tokens_in']:,} tokens in, {r['tokens_out']:,} out")


def _object_text(r: dict[str, Any]) -> str:
    return json.dumps(r["data"], ensure_ascii=False, indent=2)


def extraction_markdown(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *,
                        settings: dict[str, Any], wall_seconds: float) -> str:
    """Each document's object (or, under Failed, why there is none), its chunks and tokens; the run's
    totals and settings."""
    lines = ["# Extractions", "", _extraction_totals(records, skipped, wall_seconds), "",
             f"_{_settings_line(settings)}_", ""]
    for r in records:
        if not r.get("error"):
            lines += [f"## {r['path']}", "", "```json", _object_text(r), "```", "", f"_{_extraction_detail(r)}_", ""]
    return "\n".join(lines + _failed_and_skipped_md(records, skipped))


def extraction_html(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *,
                    settings: dict[str, Any], wall_seconds: float) -> str:
    """The Markdown extraction report's content as one self-contained HTML page (every text escaped)."""
    e = html.escape
    parts = _html_head("Extractions", _extraction_totals(records, skipped, wall_seconds), settings)
    for r in records:
        if not r.get("error"):
            parts += [f"<section><h2>{e(r['path'])}</h2>", f'<pre class="summary">{e(_object_text(r))}</pre>',
                      f'<p class="meta">{e(_extraction_detail(r))}</p>', "</section>"]
    return _html_page(parts, records, skipped)


@dataclass
class RunReport:
    documents: int
    summarised: int
    failed: int
    skipped: list[Skipped]
    chunks: int
    tokens_in: int
    tokens_out: int
    wall_seconds: float
    records: list[dict[str, Any]]

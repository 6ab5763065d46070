"""What the user sees: a live progress line on stderr, a JSONL line per document as it finishes or a
Markdown or HTML report at the end, and the run's totals."""
from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape as html_escape
from pathlib import Path
from typing import IO, Any

import jinja2
from tqdm import tqdm

from pipeline.defaults import REPORT_FORMATS
from pipeline.summarize.documents import Skipped

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"  # summary_report.md.j2, summary_report.html.j2
_BAR_CHARS = ".#"  # tqdm's ascii bar: '.' to do, '#' done


class Progress:
    """One live tqdm bar on stderr: documents and chunks done. Plain lines when stderr is not a terminal
    (a log, not a screen: a line when a document ends, otherwise at most one a second)."""

    def __init__(self, total_docs: int, total_chunks: int, stream: IO[str] | None = None, width: int = 24):
        self.total_docs = total_docs
        self.total_chunks = total_chunks
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.width = width
        self.t0 = time.monotonic()
        self._bar: tqdm | None = None
        self._last: tuple[int, int, int] | None = None
        self._last_draw = 0.0

    def _text(self, docs: int, chunks: int, failed: int) -> str:
        text = (f"documents {docs}/{self.total_docs}  chunks {chunks}/{self.total_chunks}"
                f"  {time.monotonic() - self.t0:6.1f}s")
        return text + (f"  ({failed} failed)" if failed else "")

    def _bar_format(self, text: str) -> str:
        return f"[{{bar:{self.width}}}] " + text.replace("{", "{{").replace("}", "}}")

    def line(self, docs: int, chunks: int, failed: int) -> str:
        return tqdm.format_meter(docs + chunks, max(1, self.total_chunks + self.total_docs), 0, ascii=_BAR_CHARS,
                                 bar_format=self._bar_format(self._text(docs, chunks, failed)))

    def update(self, docs: int, chunks: int, failed: int = 0, *, force: bool = False) -> None:
        state = (docs, chunks, failed)
        now = time.monotonic()
        if self.tty:
            if state == self._last and not force and now - self._last_draw < 0.5:
                return
            bar_format, total = self._bar_format(self._text(docs, chunks, failed)), self.total_chunks + self.total_docs
            if self._bar is None:
                self._bar = tqdm(total=max(1, total), initial=docs + chunks, bar_format=bar_format, file=self.stream,
                                 ascii=_BAR_CHARS, mininterval=0, dynamic_ncols=True)
            else:
                self._bar.bar_format, self._bar.total, self._bar.n = bar_format, max(1, total), docs + chunks
                self._bar.refresh()
        else:
            if not force and (state == self._last or (
                    self._last is not None and state[0::2] == self._last[0::2] and now - self._last_draw < 1.0)):
                return
            self.stream.write(self.line(docs, chunks, failed) + "\n")
            self.stream.flush()
        self._last, self._last_draw = state, now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def message(self, text: str) -> None:
        """A line above the bar (tqdm clears the bar and draws it again below)."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()
        self._last = None


FORMATS = REPORT_FORMATS


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


@functools.cache
def _template(name: str, html: bool) -> jinja2.Template:
    # The HTML page escapes every value it prints (finalize), so no template text can forget to.
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES_DIR), trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, autoescape=False, undefined=jinja2.StrictUndefined,
                             finalize=html_escape if html else None)
    return env.get_template(name)


def _report_context(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], settings: dict[str, Any],
                    wall_seconds: float) -> dict[str, Any]:
    return {"totals": _totals(records, skipped, wall_seconds), "settings_line": _settings_line(settings),
            "documents": [{**r, "title": r.get("title"), "summary": r.get("summary"), "sections": r.get("sections"),
                           "detail": _detail(r)} for r in records if not r.get("error")],
            "failed": [Skipped(r["path"], r["error"]) for r in records if r.get("error")],
            "skipped": list(skipped)}


def markdown_report(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *, settings: dict[str, Any],
                    wall_seconds: float) -> str:
    """Each document's title, file, summary and section list, its time and tokens; the run's totals
    and the settings it ran with."""
    return _template("summary_report.md.j2", False).render(_report_context(records, skipped, settings, wall_seconds))


def html_report(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *, settings: dict[str, Any],
                wall_seconds: float) -> str:
    """The Markdown report's content as one self-contained HTML page (every text escaped)."""
    return _template("summary_report.html.j2", True).render(_report_context(records, skipped, settings, wall_seconds))


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


def _extraction_context(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], settings: dict[str, Any],
                        wall_seconds: float) -> dict[str, Any]:
    return {"totals": _extraction_totals(records, skipped, wall_seconds), "settings_line": _settings_line(settings),
            "documents": [{"path": r["path"], "object": _object_text(r), "detail": _extraction_detail(r)}
                          for r in records if not r.get("error")],
            "failed": [Skipped(r["path"], r["error"]) for r in records if r.get("error")],
            "skipped": list(skipped)}


def extraction_markdown(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *,
                        settings: dict[str, Any], wall_seconds: float) -> str:
    """Each document's object (or, under Failed, why there is none), its chunks and tokens; the run's
    totals and settings."""
    return _template("extraction_report.md.j2", False).render(
        _extraction_context(records, skipped, settings, wall_seconds))


def extraction_html(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *,
                    settings: dict[str, Any], wall_seconds: float) -> str:
    """The Markdown extraction report's content as one self-contained HTML page (every text escaped)."""
    return _template("extraction_report.html.j2", True).render(
        _extraction_context(records, skipped, settings, wall_seconds))


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

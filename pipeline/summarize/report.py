"""What the user sees: a live progress line on stderr, a JSONL line per document as it finishes or a
Markdown report at the end, and the run's totals."""
from __future__ import annotations

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


class Output:
    """JSONL: a line per document as it finishes. Markdown: a report written at the end."""

    def __init__(self, stream: IO[str], fmt: str, *, model: str):
        if fmt not in ("jsonl", "md"):
            raise ValueError(f"unknown format {fmt!r}")
        self.stream = stream
        self.fmt = fmt
        self.model = model
        self.records: list[tuple[int, dict[str, Any]]] = []

    def add(self, index: int, record: dict[str, Any]) -> None:
        self.records.append((index, record))
        if self.fmt == "jsonl":
            self.stream.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.stream.flush()

    def finish(self, skipped: Sequence[Skipped], *, wall_seconds: float) -> None:
        if self.fmt == "md":
            self.stream.write(markdown_report([r for _, r in sorted(self.records, key=lambda x: x[0])], skipped,
                                              model=self.model, wall_seconds=wall_seconds))
            self.stream.flush()


def markdown_report(records: Sequence[dict[str, Any]], skipped: Sequence[Skipped], *, model: str,
                    wall_seconds: float) -> str:
    ok = [r for r in records if not r.get("error")]
    failed = [r for r in records if r.get("error")]
    lines = ["# Summaries", ""]
    lines.append(f"{len(ok)} document{'s' if len(ok) != 1 else ''} summarised"
                 + (f", {len(failed)} failed" if failed else "")
                 + (f", {len(skipped)} skipped" if skipped else "")
                 + f" with `{model}` in {wall_seconds:.1f} s.")
    lines.append("")
    for r in ok:
        lines += [f"## {r['path']}", "", (r.get("summary") or "_(empty summary)_").strip(), ""]
        detail = (f"{r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}"
                  + (f", {r['reduce_levels']} reduce level{'s' if r['reduce_levels'] != 1 else ''}" if r["reduce_levels"] else "")
                  + f" · {r['tokens_in']:,} tokens in, {r['tokens_out']:,} out · {r['seconds']:.1f} s")
        lines += [f"_{detail}_", ""]
    if failed:
        lines += ["## Failed", ""]
        lines += [f"- `{r['path']}`: {r['error']}" for r in failed]
        lines.append("")
    if skipped:
        lines += ["## Skipped", ""]
        lines += [f"- `{s.path}`: {s.reason}" for s in skipped]
        lines.append("")
    return "\n".join(lines)


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

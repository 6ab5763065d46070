"""Summarisation as one typed unit: how its prompts are filled, how a reply is tidied, and what a job and a
document come to. The producer's planner (pipeline.summarize) and the workers' tasks
(jobs.summarize_tasks) both call this module, so a reduce prompt is measured at planning time exactly as
it is filled at run time, and a job's summary is the same whoever reads it from the ledger.

    ReduceSpec     a reduce job's prompt: every placeholder filled but {text}, its parts' label and
                   separator, its sampling params; messages(summaries) fills {text}
    ChunkSummary   one map or reduce job's outcome, from its JobResult in the ledger
    DocumentRecord one document's line of output, from its jobs' ChunkSummary values

Placeholders (plain text replacement): {text}, {words}, {style}, {context}; {n} and {summary} in a part.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.sentences import complete_end
from jobs.schemas import JobResult

# What {style} says in the prompts, per --style. Each asks for the content itself, in the form named.
STYLES: dict[str, str] = {
    "paragraph": "Write one paragraph of plain sentences.",
    "bullets": "Write a bulleted list: one fact per line, each line starting with '- '.",
    "key-points": "Write the three to seven most important points as a numbered list, one per line.",
    "one-line": "Write a single sentence.",
}
DEFAULT_STYLE = "paragraph"


def words_for(max_summary_tokens: int) -> int:
    """How many words to ask for so the reply usually ends before max_summary_tokens."""
    return max(8, int(max_summary_tokens * 0.6))


def document_context(title: str, section_path: tuple[str, ...] = ()) -> str:
    """The lines that tell the model where a chunk comes from: the document's title and, when the chunk
    sits under headings other than the title, their path. Empty when nothing is known."""
    lines = [f"Document: {title}"] if title else []
    path = [h for h in section_path if h != title]
    if path:
        lines.append("Section: " + " > ".join(path))
    return "".join(line + "\n" for line in lines)


def fill(template: str, *, words: int, style: str, context: str = "") -> str:
    """{words}, {style} (a key of STYLES) and {context} filled; {text} left for the caller."""
    return template.replace("{words}", str(words)).replace("{style}", STYLES[style]).replace("{context}", context)


def map_messages(system: str, user: str, text: str, *, words: int, style: str,
                 context: str = "") -> list[dict[str, str]]:
    """System + user message for one chunk. `context`: the chunk's document and section lines
    (document_context), which the built-in prompt puts after the instructions and before the text, so
    the instructions stay a prefix every chunk shares."""
    messages = []
    if system:
        messages.append({"role": "system", "content": fill(system, words=words, style=style)})
    messages.append({"role": "user", "content": fill(user, words=words, style=style, context=context)
                     .replace("{text}", text)})
    return messages


@dataclass(frozen=True)
class ReduceSpec:
    """A reduce job's prompt and settings. system and user have {style} and {context} filled (user keeps
    {text} and, like system, may keep {words}); `part` renders one input summary, `separator` joins
    them. level: 1 reduces map summaries, higher levels reduce reduce summaries (whose copied part
    labels are stripped, see labels)."""

    model: str
    system: str
    user: str
    part: str
    separator: str
    words: int
    params: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    level: int = 1

    @classmethod
    def from_templates(cls, model: str, *, system: str, user: str, part: str, separator: str, words: int,
                       style: str, context: str = "") -> ReduceSpec:
        """{words}, {style} and the document's {context} filled now, {text} by messages() at run time."""
        return cls(model=model, system=fill(system, words=words, style=style),
                   user=fill(user, words=words, style=style, context=context), part=part, separator=separator,
                   words=words)

    def to_payload(self) -> dict[str, Any]:
        """The reduce task's JSON argument."""
        return asdict(self)

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> ReduceSpec:
        known = {k: v for k, v in payload.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "params": dict(known.get("params") or {}),
                      "metadata": dict(known.get("metadata") or {})})

    def messages(self, summaries: Sequence[str]) -> list[dict[str, str]]:
        """The reduce prompt for `summaries` (in order)."""
        parts = [self.part.replace("{n}", str(i)).replace("{summary}", s.strip()) for i, s in enumerate(summaries, 1)]
        words = str(self.words)
        user = self.user.replace("{words}", words).replace("{text}", self.separator.join(parts))
        messages = []
        if self.system:
            messages.append({"role": "system", "content": self.system.replace("{words}", words)})
        messages.append({"role": "user", "content": user})
        return messages

    @property
    def labels(self) -> re.Pattern[str] | None:
        """The part labels a reply of this spec may copy (part_label_pattern)."""
        return part_label_pattern(self.part)

    def leading_that_fit(self, summaries: Sequence[str], count_tokens: Callable[[list[dict[str, str]]], int],
                         prompt_limit: int) -> int:
        """How many leading summaries one prompt holds within prompt_limit tokens (0: not even one)."""
        for n in range(len(summaries), 0, -1):
            if count_tokens(self.messages(summaries[:n])) <= prompt_limit:
                return n
        return 0

    def fit(self, summaries: Sequence[str], count_tokens: Callable[[list[dict[str, str]]], int], capacity: int,
            max_tokens: int, tokenizer: Any) -> list[str]:
        """Shorten the longest summaries (by tokens) until the prompt + reply fits `capacity`.

        The producer sizes reduce groups from the upper bound max_summary_tokens per input, so this only
        matters if re-tokenising generated text comes out longer than it was generated."""
        summaries = list(summaries)
        for _ in range(10 * len(summaries) + 10):
            over = count_tokens(self.messages(summaries)) + max_tokens - capacity
            if over <= 0:
                return summaries
            ids = [tokenizer.encode(s) for s in summaries]
            longest = max(range(len(ids)), key=lambda i: len(ids[i]))
            keep = max(0, len(ids[longest]) - over - 1)
            summaries[longest] = tokenizer.decode(ids[longest][:keep]).rstrip()
            if keep == 0 and all(not s for s in summaries):
                break
        return summaries


# A lead-in label on the first line: "Summary:", "Here is a short summary of the text:", "The summary is:".
_LABEL = re.compile(r"^\s*(?:\*\*)?[^\n:]{0,40}?\bsummary\b[^\n:]{0,40}?(?:\*\*)?\s*:(?:\*\*)?\s*", re.I)
# Markdown images, linked or not ("[![Build status](badge.svg)](ci-url)", "![logo](logo.png)"): a model
# copies a README's badge lines into its summary, where they say nothing and leave it ending mid-line.
_IMAGE = re.compile(r"\[!\[[^\]\n]*\]\([^)\s]*\)\]\([^)\s]*\)|!\[[^\]\n]*\]\([^)\s]*\)")


def tidy_summary(text: str, finish_reason: str | None) -> str:
    """Strip a leading "Summary:" label and lines made only of Markdown images (badges); when the
    model ran out of tokens mid-sentence, end the summary at its last complete sentence or line
    (engine.sentences: CJK full stops, not after "e.g." or a list number), if that keeps at least
    a third of it."""
    out = _LABEL.sub("", text.strip(), count=1).strip()
    out = "\n".join(line for line in out.split("\n") if not _IMAGE.search(line) or _IMAGE.sub("", line).strip())
    out = re.sub(r"\n{3,}", "\n\n", out).strip()
    if finish_reason == "length":
        end = complete_end(out)
        if end and end >= len(out) // 3:
            out = out[:end]
    return out.strip()


def part_label_pattern(part: str) -> re.Pattern[str] | None:
    """A regex for the label the reduce template puts before each summary ("Part {n}: ").

    Small models copy that scaffolding into their answer; it is ours, so it is taken out again."""
    head = part.split("{summary}", 1)[0]
    if "{n}" not in head or not head.strip():
        return None
    pieces = [re.escape(x) for x in head.strip().split("{n}")]
    return re.compile(r"(?m)^[ \t]*" + r"\d+".join(pieces) + r"[ \t]*")


@dataclass(frozen=True)
class ChunkSummary:
    """One map or reduce job's outcome, from the JobResult the ledger holds for it."""

    summary: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    prefix_hit_tokens: int
    draft_tokens: int
    accepted_tokens: int
    inputs: int  # summaries it combined (1 for a map job)
    generation_id: str | None
    worker: str | None

    @classmethod
    def from_result(cls, result: JobResult, *, inputs: int = 1,
                    labels: re.Pattern[str] | None = None) -> ChunkSummary:
        """labels: the part labels a reduce job's reply may have copied (ReduceSpec.labels), stripped."""
        text = labels.sub("", result.text) if labels is not None else result.text
        return cls(summary=tidy_summary(text, result.finish_reason), finish_reason=result.finish_reason,
                   prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                   seconds=round(result.prefill_seconds + result.decode_seconds, 4),
                   prefix_hit_tokens=result.prefix_hit_tokens, draft_tokens=result.draft_tokens,
                   accepted_tokens=result.accepted_tokens, inputs=inputs, generation_id=result.job_id,
                   worker=result.worker)


@dataclass(frozen=True)
class DocumentRecord:
    """One document's outcome: its summary (None when a job failed) and what it cost. to_dict() is
    the JSONL line and the reports' input."""

    path: str
    title: str
    sections: list[str]
    summary: str | None
    chunks: int
    reduce_levels: int
    jobs: int
    tokens_in: int
    tokens_out: int
    prefix_hit_tokens: int
    draft_tokens: int
    accepted_tokens: int
    seconds: float  # from submission to the last job's end
    compute_seconds: float  # the jobs' own prefill and decode time
    model: str
    bytes: int
    encoding: str
    encoding_note: str | None = None
    error: str | None = None
    truncated: bool = False  # max_tokens ended the final summary

    @classmethod
    def build(cls, *, path: str, title: str, sections: Sequence[str], chunks: int, reduce_levels: int, jobs: int,
              results: Sequence[ChunkSummary], final: ChunkSummary | None, error: str | None, seconds: float,
              model: str, size: int, encoding: str, encoding_note: str | None = None) -> DocumentRecord:
        """From the document's jobs that ended (`results`), its final one when it has ended, and the
        error of a job that failed."""
        return cls(
            path=path, title=title, sections=list(sections),
            summary=final.summary if final is not None and error is None else None,
            chunks=chunks, reduce_levels=reduce_levels, jobs=jobs,
            tokens_in=sum(r.prompt_tokens for r in results), tokens_out=sum(r.completion_tokens for r in results),
            prefix_hit_tokens=sum(r.prefix_hit_tokens for r in results),
            draft_tokens=sum(r.draft_tokens for r in results),
            accepted_tokens=sum(r.accepted_tokens for r in results),
            seconds=round(seconds, 3), compute_seconds=round(sum(r.seconds for r in results), 3),
            model=model, bytes=size, encoding=encoding, encoding_note=encoding_note, error=error,
            truncated=error is None and final is not None and final.finish_reason == "length")

    def to_dict(self) -> dict[str, Any]:
        """The record, with encoding_note, error and truncated only when they say something."""
        out = asdict(self)
        for key in ("encoding_note", "error"):
            if out[key] is None:
                del out[key]
        if not out["truncated"]:
            del out["truncated"]
        return out

"""The prompts: the built-in map and reduce templates (pipeline/templates/summarize.toml), a user's
override file laid over them, and the words a summary is asked to stay within."""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.summarize.errors import SummarizeError

DEFAULT_TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "summarize.toml"

# What {style} says in the prompts, per --style. Each asks for the content itself, in the form named.
STYLES: dict[str, str] = {
    "paragraph": "Write one paragraph of plain sentences.",
    "bullets": "Write a bulleted list: one fact per line, each line starting with '- '.",
    "key-points": "Write the three to seven most important points as a numbered list, one per line.",
    "one-line": "Write a single sentence.",
}
DEFAULT_STYLE = "paragraph"


@dataclass(frozen=True)
class Templates:
    map_system: str
    map_user: str
    reduce_system: str
    reduce_user: str
    part: str
    separator: str
    source: str = "built-in"
    style: str = DEFAULT_STYLE

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, *, style: str = DEFAULT_STYLE) -> Templates:
        """The built-in templates, with any keys of `path` (TOML or JSON) laid over them; `style` (a key of
        STYLES) fills their {style} placeholders."""
        if style not in STYLES:
            raise SummarizeError(f"unknown style {style!r}; choose one of: {', '.join(STYLES)}")
        base = _read_template_file(DEFAULT_TEMPLATE)
        source = "built-in"
        if path is not None:
            user = _read_template_file(Path(path))
            for section in ("map", "reduce"):
                extra = user.get(section) or {}
                if not isinstance(extra, dict):
                    raise SummarizeError(f"{path}: [{section}] must be a table")
                unknown = set(extra) - set(base[section])
                if unknown:
                    raise SummarizeError(f"{path}: unknown key(s) in [{section}]: {', '.join(sorted(unknown))}")
                base[section].update(extra)
            unknown_sections = set(user) - {"map", "reduce"}
            if unknown_sections:
                raise SummarizeError(f"{path}: unknown section(s): {', '.join(sorted(unknown_sections))}")
            source = str(path)
        m, r = base["map"], base["reduce"]
        t = cls(map_system=m.get("system", ""), map_user=m["user"], reduce_system=r.get("system", ""),
                reduce_user=r["user"], part=r.get("part", "Part {n}: {summary}"),
                separator=r.get("separator", "\n\n"), source=source, style=style)
        for name, value, needed in (("[map] user", t.map_user, "{text}"), ("[reduce] user", t.reduce_user, "{text}"),
                                    ("[reduce] part", t.part, "{summary}")):
            if not isinstance(value, str) or needed not in value:
                raise SummarizeError(f"{source}: {name} must contain {needed}")
        if "{text}" in t.map_system or "{text}" in t.reduce_system:
            raise SummarizeError(f"{source}: put {{text}} in the user message, not the system message")
        return t

    def _fill(self, template: str, words: int, context: str) -> str:
        return (template.replace("{words}", str(words)).replace("{style}", STYLES[self.style])
                .replace("{context}", context))

    def map_messages(self, text: str, words: int, context: str = "") -> list[dict[str, str]]:
        """System + user message for one chunk. `context`: the chunk's document and section lines
        (document_context), which the built-in prompt puts after the instructions and before the text,
        so the instructions stay a prefix every chunk shares."""
        messages = []
        if self.map_system:
            messages.append({"role": "system", "content": self._fill(self.map_system, words, "")})
        messages.append({"role": "user", "content": self._fill(self.map_user, words, context).replace("{text}", text)})
        return messages

    def reduce_spec(self, model: str, words: int, context: str = "") -> dict[str, Any]:
        """The template part of a reduce job's arguments: {words}, {style} and the document's {context}
        filled here, {text} (the parts) by the worker at run time."""
        return {"model": model, "system": self._fill(self.reduce_system, words, ""),
                "user": self._fill(self.reduce_user, words, context),
                "part": self.part, "separator": self.separator, "words": words}


def document_context(title: str, section_path: tuple[str, ...] = ()) -> str:
    """The lines that tell the model where a chunk comes from: the document's title and, when the chunk
    sits under headings other than the title, their path. Empty when nothing is known."""
    lines = [f"Document: {title}"] if title else []
    path = [h for h in section_path if h != title]
    if path:
        lines.append("Section: " + " > ".join(path))
    return "".join(line + "\n" for line in lines)


def _read_template_file(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SummarizeError(f"cannot read template file {path}: {e.strerror or e}") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(raw)
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SummarizeError(f"template file {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(data, dict):
        raise SummarizeError(f"template file {path} must hold a table with [map] and/or [reduce]")
    return {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}


def words_for(max_summary_tokens: int) -> int:
    """How many words to ask for so the reply usually ends before max_summary_tokens."""
    return max(8, int(max_summary_tokens * 0.6))

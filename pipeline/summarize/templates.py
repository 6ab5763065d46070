"""The prompt templates: the built-in map and reduce templates (pipeline/templates/summarize.toml) and a
user's override file laid over them. Filling them is jobs.summary_unit's, shared with the workers."""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.summary_unit import (DEFAULT_STYLE, STYLES, ReduceSpec, document_context,  # noqa: F401 (re-exported)
                               map_messages, words_for)
from pipeline.summarize.errors import SummarizeError

DEFAULT_TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "summarize.toml"

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

    def map_messages(self, text: str, words: int, context: str = "") -> list[dict[str, str]]:
        """System + user message for one chunk (jobs.summary_unit.map_messages)."""
        return map_messages(self.map_system, self.map_user, text, words=words, style=self.style, context=context)

    def reduce_spec(self, model: str, words: int, context: str = "") -> ReduceSpec:
        """A reduce job's prompt: {words}, {style} and the document's {context} filled here, {text} (the
        parts) by the worker at run time (ReduceSpec.messages)."""
        return ReduceSpec.from_templates(model, system=self.reduce_system, user=self.reduce_user, part=self.part,
                                         separator=self.separator, words=words, style=self.style, context=context)


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

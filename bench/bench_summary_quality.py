"""How good are `rqllm summarize`'s summaries? Reference-free figures per model and prompt template
on a corpus of 16 documents of mixed kinds (bench/quality_corpus.toml), in one table.

    python -m bench.bench_summary_quality                                   # smollm2-135m, all documents
    python -m bench.bench_summary_quality --model smollm2-135m --model gemma3-270m --model /path/other.gguf \\
        --template default --template my-template.toml
    python -m bench.bench_summary_quality --doc apache-2.0 --doc team-sync-notes --doc rq-readme --json out.json
    python -m bench.bench_summary_quality --collect-only /tmp/corpus      # just write the corpus files

Each model x template runs the real CLI - `rqllm summarize CORPUS_DIR --format jsonl --model M
[--template T]` in embedded mode (its own redis-server and workers) - and is timed from start to
exit. The corpus files are collected from installed packages (bench/quality_corpus.toml says which)
into a temporary folder, or into --corpus-dir.

Columns (bench/summary_metrics.py defines them): recall = key-term recall (the share of each
document's 8 most distinctive words by tf-idf over the whole corpus that its summary uses; higher is
better), repeat = share of word 4-grams occurring more than once (lower), cut = summaries ending
mid-sentence, unsup = share of the summaries' names, numbers and capitalised terms that are not in
the document (0 is the goal), framed = summaries about the text rather than of it, echo = summaries
repeating the prompt's instructions (a model that cannot chat), words = mean
summary length, wall = seconds for the whole run. Goals: recall >= 0.55, repeat <= 0.05,
cut 0, unsup 0.
"""
from __future__ import annotations

import email
import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import click
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bench import summary_metrics as metrics

ROOT = Path(__file__).resolve().parent.parent

MANIFEST = ROOT / "bench" / "quality_corpus.toml"


class CorpusError(RuntimeError):
    """A corpus document that cannot be collected, naming it and what would provide it."""


class CorpusEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    kind: Literal["legal", "technical", "narrative", "notes", "code"]
    source: Literal["debian", "pypi", "stdlib", "repo"]
    licence: str = Field(min_length=1)
    path: str | None = None
    package: str | None = None
    between: tuple[str, str] | None = None
    max_chars: int | None = Field(None, ge=1000)

    @model_validator(mode="after")
    def _source_fields(self) -> CorpusEntry:
        if self.source in ("debian", "stdlib", "repo") and not self.path:
            raise ValueError(f"document {self.name}: a {self.source} source needs `path`")
        if self.source in ("debian", "pypi") and not self.package:
            raise ValueError(f"document {self.name}: a {self.source} source needs `package`")
        return self


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    document: list[CorpusEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Manifest:
        names = [d.name for d in self.document]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"document names repeat: {', '.join(dupes)}")
        return self


def read_manifest(path: Path = MANIFEST) -> Manifest:
    try:
        return Manifest.model_validate(tomllib.loads(path.read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError, ValidationError) as e:
        raise CorpusError(f"{path}: {e}") from None


def document_text(entry: CorpusEntry) -> tuple[str, str]:
    """(text, file suffix) of one corpus document."""
    if entry.source == "pypi":
        try:
            raw = importlib.metadata.distribution(entry.package).read_text("METADATA")
        except importlib.metadata.PackageNotFoundError:
            raise CorpusError(f"document {entry.name}: PyPI package {entry.package} is not installed "
                              f"(pip install {entry.package})") from None
        message = email.message_from_string(raw or "")
        text = message.get_payload() or message.get("Description") or ""
        suffix = ".rst" if "rst" in (message.get("Description-Content-Type") or "") else ".md"
    else:
        base = {"debian": Path("/"), "stdlib": Path(sysconfig.get_paths()["stdlib"]), "repo": ROOT}[entry.source]
        path = base / entry.path
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            hint = f" (Debian package {entry.package})" if entry.source == "debian" else ""
            raise CorpusError(f"document {entry.name}: cannot read {path}{hint}: {e.strerror or e}") from None
        suffix = path.suffix if path.suffix in (".md", ".rst") else ".txt"
    if entry.between is not None:
        first, after = entry.between
        start, stop = text.find(first), text.find(after)
        if start < 0 or stop <= start:
            raise CorpusError(f"document {entry.name}: the text between {first!r} and {after!r} is not there")
        text = text[start:stop]
    if entry.max_chars is not None and len(text) > entry.max_chars:
        cut = text.rfind("\n\n", 0, entry.max_chars)
        text = text[:cut if cut > 0 else entry.max_chars]
    if not text.strip():
        raise CorpusError(f"document {entry.name}: empty")
    return text.strip() + "\n", suffix


def collect_corpus(dest: Path, names: list[str] | None = None, manifest: Manifest | None = None) -> dict[str, Path]:
    """Write the corpus documents (all, or `names`) into `dest`; {name: file}."""
    manifest = manifest or read_manifest()
    known = {d.name: d for d in manifest.document}
    unknown = sorted(set(names or []) - set(known))
    if unknown:
        raise CorpusError(f"unknown document(s): {', '.join(unknown)}; the corpus has {', '.join(known)}")
    dest.mkdir(parents=True, exist_ok=True)
    files = {}
    for entry in manifest.document:
        if names and entry.name not in names:
            continue
        text, suffix = document_text(entry)
        files[entry.name] = dest / f"{entry.name}{suffix}"
        files[entry.name].write_text(text, encoding="utf-8")
    return files


def summarize_command(corpus_dir: Path, out: Path, model: str, template: str | None, *, max_summary_tokens: int,
                      kv_budget: str | None = None, workers: int | None = None) -> list[str]:
    cmd = ["summarize", str(corpus_dir), "--format", "jsonl", "-o", str(out), "--model", model,
           "--max-summary-tokens", str(max_summary_tokens)]
    if template:
        cmd += ["--template", template]
    if kv_budget:
        cmd += ["--kv-budget", kv_budget]
    if workers:
        cmd += ["--workers", str(workers)]
    return cmd


def run_summarize(cmd: list[str]) -> tuple[float, str]:
    """Run `rqllm <cmd>` from this checkout; (wall seconds, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("REDIS_URL", None)  # embedded mode: the run's own redis-server and workers
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", *cmd], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"rqllm {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, proc.stderr


def chat_note(model: str) -> str:
    from engine.chat_capability import model_chat_capability
    from engine.registry import resolve

    try:
        cap = model_chat_capability(resolve(model, auto_pull=False))
    except Exception as e:  # noqa: BLE001 - a note in the table, not a failure of the run
        return f"? ({type(e).__name__})"
    return "template" if cap.has_template else ("instruct name" if cap.can_chat else "NO (base model)")


def template_instructions(template: str | None) -> str:
    """The template's text (every message of map and reduce), for the echo check."""
    from pipeline.summarize import Templates

    t = Templates.load(template)
    return "\n".join([t.map_system, t.map_user, t.reduce_system, t.reduce_user])


def score_run(records: list[dict], texts: dict[str, str], terms: dict[str, list[str]],
              instructions: str = "") -> list[metrics.SummaryScore]:
    scores = []
    for rec in records:
        name = Path(rec["path"]).stem
        if rec.get("summary") is None:
            raise RuntimeError(f"{name}: no summary ({rec.get('error')})")
        scores.append(metrics.score_summary(name, rec["summary"], texts[name], terms[name],
                                            truncated=bool(rec.get("truncated")), instructions=instructions))
    return scores


@click.command(help=__doc__)
@click.option("--model", "models", multiple=True, default=("smollm2-135m",), show_default=True,
              help="A name `rqllm models` knows, or a .gguf path (repeatable).")
@click.option("--template", "templates", multiple=True, default=("default",), show_default=True,
              help="'default' or a template file, as summarize's --template (repeatable).")
@click.option("--doc", "docs", multiple=True, help="A document of the corpus, by name (repeatable; default: all).")
@click.option("--corpus-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Collect the corpus here (default: a temp dir).")
@click.option("--collect-only", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Write the corpus to DIR and stop.")
@click.option("--max-summary-tokens", type=int, default=160, show_default=True)
@click.option("--kv-budget", default=None)
@click.option("--workers", type=int, default=None)
@click.option("--per-doc", is_flag=True, help="Also print each document's figures and summary.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write every figure and summary here.")
def main(models: tuple[str, ...], templates: tuple[str, ...], docs: tuple[str, ...], corpus_dir: Path | None,
         collect_only: Path | None, max_summary_tokens: int, kv_budget: str | None, workers: int | None, per_doc: bool,
         json_path: Path | None) -> None:

    manifest = read_manifest()
    if collect_only:
        files = collect_corpus(collect_only, list(docs) or None, manifest)
        print(f"{len(files)} documents in {collect_only}")
        return
    # Key terms come from the whole corpus, whichever documents run: figures stay comparable.
    texts = {e.name: document_text(e)[0] for e in manifest.document}
    terms = metrics.key_terms(texts)
    tmp = tempfile.TemporaryDirectory(prefix="rqllm-quality-")
    corpus_dir = corpus_dir or Path(tmp.name) / "corpus"
    files = collect_corpus(corpus_dir, list(docs) or None, manifest)
    print(f"corpus: {len(files)} documents in {corpus_dir}", file=sys.stderr)

    rows, details = [], []
    for model in models:
        chat = chat_note(model)
        for template in templates:
            out = Path(tmp.name) / "summaries.jsonl"
            cmd = summarize_command(corpus_dir, out, model, None if template == "default" else template,
                                    max_summary_tokens=max_summary_tokens, kv_budget=kv_budget,
                                    workers=workers)
            print(f"rqllm {' '.join(cmd)}", file=sys.stderr)
            wall, _ = run_summarize(cmd)
            records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
            scores = score_run(records, texts, terms, template_instructions(None if template == "default" else template))
            total = metrics.score_corpus(scores)
            rows.append((model, template, chat, total, wall))
            details.append({"model": model, "template": template, "chat": chat, "command": "rqllm " + " ".join(cmd),
                            "wall_seconds": round(wall, 1), "total": asdict(total),
                            "documents": [dict(asdict(s), summary=r["summary"], truncated=bool(r.get("truncated")),
                                               chunks=r.get("chunks"),
                                               seconds=r.get("seconds"), tokens_out=r.get("tokens_out"))
                                          for s, r in zip(scores, records)]})
            if per_doc:
                for s, r in sorted(zip(scores, records), key=lambda x: x[0].name):
                    print(f"\n## {s.name} ({model}, {template}): recall {s.key_term_recall:.2f} repeat "
                          f"{s.repetition:.2f} cut {int(s.cut_off)} unsup {s.unsupported:.2f} "
                          f"{list(s.unsupported_words)[:6]} framed {int(s.framing)} echo {int(s.echo)}\nkey terms: "
                          f"{', '.join(s.key_terms)}\n{r['summary']}")
    print()
    print("| model | template | chat | docs | recall | repeat | cut | unsup | framed | echo | words | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, template, chat, t, wall in rows:
        n = t.documents
        print(f"| {model} | {template} | {chat} | {n} | {t.key_term_recall:.2f} | {t.repetition:.2f} | {t.cut_off}/{n} | "
              f"{t.unsupported:.2f} | {t.framing}/{n} | {t.echo}/{n} | {t.words:.0f} | {wall:.0f} |")
    if json_path:
        json_path.write_text(json.dumps({"runs": details}, indent=1, ensure_ascii=False), encoding="utf-8")
    tmp.cleanup()


if __name__ == "__main__":
    try:
        main()
    except CorpusError as e:
        raise SystemExit(f"error: {e}") from None

"""CLI command for bulk extraction: extract."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from engine.defaults import DEFAULT_MODEL
from pipeline.cli_options import kv_budget_option, no_repack_option, redis_url_option, threads_option, workers_option
from pipeline.extract import DEFAULT_MAX_TOKENS, FORMATS
from pipeline.summarize import DEFAULT_MAX_BYTES, SummarizeError


@click.command("extract")
@click.argument("paths", nargs=-1, required=True)
@click.option("--schema", "schema_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help="JSON schema file: each document gives one object valid for it.")
@click.option("--instructions", default=None, help="More instructions for the model (what to look for).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), default="-", show_default=True,
              help="Where to write ('-' = stdout).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="jsonl: a line per document; csv: the top-level fields as columns; md or html: a report "
                   "(each document's object or why it failed, chunks and tokens, totals, the settings used). "
                   "Default: from the output's extension (.csv, .md, .html), else jsonl.")
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True, help="Model name or .gguf path.")
@workers_option(help="Worker processes to start when running embedded (no REDIS_URL).", short=True)
@threads_option(help="Engine threads per embedded worker.")
@kv_budget_option(help="Workers' KV cache budget (256MiB, or tokens: 2048tok).")
@click.option("--max-tokens", type=click.IntRange(8, 8192), default=DEFAULT_MAX_TOKENS, show_default=True,
              help="Longest object, in tokens.")
@click.option("--max-bytes", type=click.IntRange(1), default=DEFAULT_MAX_BYTES, show_default=True,
              help="Skip files larger than this.")
@redis_url_option(help="Submit to this Redis and wait (default $REDIS_URL); unset = embedded cluster.")
@no_repack_option(help="Embedded workers compute on the GGUF's own layout.")
def extract_command(paths: tuple[str, ...], schema_file: str, instructions: str | None, output: str,
                    fmt: str | None, model: str,
                    workers: int | None, threads: int | None, kv_budget: str | None, max_tokens: int,
                    max_bytes: int, redis_url: str | None, no_repack: bool) -> None:
    """Extract the fields of a JSON schema from every document: PATHS are files, folders (recursive) or
    globs. One job per document, decoded under the schema's grammar: each object parses and is valid."""
    from pipeline.extract import extract

    try:
        schema = json.loads(Path(schema_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise click.ClickException(f"--schema {schema_file}: not a JSON file ({exc})") from None
    if not isinstance(schema, dict):
        raise click.ClickException(f"--schema {schema_file}: a schema is a JSON object")
    if fmt is None:
        suffix = Path(output).suffix.lower().lstrip(".")
        fmt = suffix if suffix in ("csv", "md", "html") else "jsonl"
    stream = sys.stdout if output == "-" else open(output, "w", encoding="utf-8", newline="")  # noqa: SIM115
    try:
        report = extract(list(paths), schema=schema, output=stream, fmt=fmt, instructions=instructions, model=model,
                         workers=workers, threads=threads, kv_budget=kv_budget, max_tokens=max_tokens,
                         max_bytes=max_bytes, redis_url=redis_url or None, repack=not no_repack,
                         schema_name=Path(schema_file).name)
    except SummarizeError as e:
        raise click.ClickException(str(e)) from None
    finally:
        if stream is not sys.stdout:
            stream.close()
    if not report.extractions or report.failed:
        raise SystemExit(1)


COMMANDS: list[click.Command] = [extract_command]

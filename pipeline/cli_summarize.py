"""CLI command for bulk summarisation: summarize."""
from __future__ import annotations

import sys

import click

from engine.defaults import DEFAULT_MODEL
from engine.params import SPECULATIVE_MODES
from pipeline.cli_options import kv_budget_option, no_repack_option, redis_url_option, threads_option, workers_option
from pipeline.defaults import REPORT_FORMATS
from pipeline.summarize import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_SUMMARY_TOKENS,
    DEFAULT_OVERLAP_TOKENS,
    DEFAULT_SPECULATIVE,
    DEFAULT_STYLE,
    STYLES,
    SummarizeError,
)


@click.command("summarize")
@click.argument("paths", nargs=-1, required=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), default="-", show_default=True,
              help="Where to write the summaries ('-' = stdout).")
@click.option("--format", "fmt", type=click.Choice(REPORT_FORMATS), default="jsonl", show_default=True,
              help="jsonl: one line per document as it finishes; md or html: a report at the end (each "
                   "document's title, summary and sections, time and tokens, the settings used).")
@click.option("--style", type=click.Choice(list(STYLES)), default=DEFAULT_STYLE, show_default=True,
              help="The summaries' form: one paragraph, a bulleted list of facts, numbered key points, or one "
                   "sentence.")
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True, help="Model name or .gguf path.")
@workers_option(help="Worker processes to start when running embedded (no REDIS_URL). Default: one per usable "
                    "CPU, at most one per chunk and as many as memory holds; the rest of the CPUs become threads.",
                short=True)
@threads_option(help="Engine threads per embedded worker (default: $RQLLM_THREADS, else the CPUs this process "
                     "may use, affinity mask and cgroup quota, / workers).")
@click.option("--template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Prompt template file (TOML or JSON) with [map] and/or [reduce] keys to override.")
@kv_budget_option(help="Workers' KV cache budget: bytes as for `rqllm worker --kv-budget` (256MiB), or tokens "
                      "(1024tok). Chunks are sized to fit it. Default: the worker default, 256MiB; with REDIS_URL, "
                      "the smallest KV capacity the live workers of the model publish (this lowers it).")
@click.option("--max-summary-tokens", type=click.IntRange(8, 4096), default=DEFAULT_MAX_SUMMARY_TOKENS,
              show_default=True, help="Longest summary (per chunk and per document), in tokens.")
@click.option("--overlap-tokens", type=click.IntRange(0, 512), default=DEFAULT_OVERLAP_TOKENS, show_default=True,
              help="Tokens of context repeated from the end of one chunk at the start of the next.")
@click.option("--chunk-tokens", type=click.IntRange(64, 1 << 20), default=DEFAULT_CHUNK_TOKENS, show_default=True,
              help="Most document tokens per chunk (chunks are also kept within the KV budget).")
@click.option("--max-bytes", type=click.IntRange(1), default=DEFAULT_MAX_BYTES, show_default=True,
              help="Skip files larger than this.")
@redis_url_option(help="Submit to this Redis and follow (default $REDIS_URL); unset = embedded cluster.")
@no_repack_option(help="Embedded workers compute on the GGUF's own layout (no repacked weight cache).")
@click.option("--speculative", type=click.Choice(SPECULATIVE_MODES), default=DEFAULT_SPECULATIVE,
              show_default=True, help="How map and reduce jobs guess tokens ahead (the summaries are the same; "
                                      "draft: the workers' --draft model).")
def summarize_command(paths: tuple[str, ...], output: str, fmt: str, model: str, workers: int | None, threads: int | None,
                      template: str | None, kv_budget: str | None, max_summary_tokens: int, overlap_tokens: int,
                      chunk_tokens: int, max_bytes: int, redis_url: str | None, no_repack: bool,
                      speculative: str, style: str) -> None:
    """Summarise text and Markdown files: PATHS are files, folders (recursive) or globs.

    Each document is split into chunks that fit the workers' KV budget, each chunk is summarised
    by one job (map), and a job that depends on all of them combines the partial summaries
    (reduce, in levels if needed). Skipped files are listed on stderr with the reason; progress
    is shown on stderr.
    """
    from pipeline.summarize import summarize

    stream = sys.stdout if output == "-" else open(output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        report = summarize(list(paths), output=stream, fmt=fmt, model=model, workers=workers, threads=threads,
                           template=template, kv_budget=kv_budget, max_summary_tokens=max_summary_tokens,
                           overlap_tokens=overlap_tokens, chunk_tokens=chunk_tokens, max_bytes=max_bytes, redis_url=redis_url or None,
                           repack=not no_repack, speculative=speculative, style=style)
    except SummarizeError as e:
        raise click.ClickException(str(e)) from None
    finally:
        if stream is not sys.stdout:
            stream.close()
    if report.documents == 0 or report.failed:
        raise SystemExit(1)


COMMANDS: list[click.Command] = [summarize_command]

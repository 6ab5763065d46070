"""Wall time and tokens for `rqllm summarize examples/`: the default split, 1 and 2 embedded workers.

    python -m bench.bench_summarize                       # examples/: the default split, 1 and 2 workers
    python -m bench.bench_summarize --workers 1 --workers 2 --workers 4 --kv-budget 1024tok --max-summary-tokens 64
    python -m bench.bench_summarize --json bench-summarize.json

Each run is a full `summarize()` in embedded mode: a private redis-server plus N worker processes
(threads per worker = usable CPUs // N; "default": the split rqllm summarize picks by itself), so the wall time includes starting the
workers and loading the model in each. "tok/s" is (tokens in + tokens out) / wall time;
"compute s" sums the engine's prefill + decode time over all jobs (workers in parallel overlap).
"""
from __future__ import annotations

import io
import json
import os
import re
import sys
import time
from pathlib import Path

import click

from pipeline.summarize import summarize

ROOT = Path(__file__).resolve().parent.parent

def run_once(paths: list[str], *, workers: int | None, kv_budget: str, max_summary_tokens: int, model: str) -> dict:
    """workers None: the embedded default split (pipeline.embedded.choose_embedded_split)."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    report = summarize(paths, output=out, fmt="jsonl", model=model, workers=workers, kv_budget=kv_budget,
                       max_summary_tokens=max_summary_tokens, redis_url="", progress_stream=err)
    wall = time.perf_counter() - t0
    if report.failed:
        raise SystemExit(f"{report.failed} document(s) failed:\n{err.getvalue()}")
    split = re.search(r"embedded: (\d+) worker\(s\) x (\d+) engine thread", err.getvalue())
    return {
        "split": "default" if workers is None else "given",
        "workers": int(split.group(1)) if split else workers,
        "threads_per_worker": int(split.group(2)) if split else 0,
        "documents": report.documents,
        "chunks": report.chunks,
        "jobs": sum(r["jobs"] for r in report.records),
        "tokens_in": report.tokens_in,
        "tokens_out": report.tokens_out,
        "wall_seconds": round(wall, 2),
        "compute_seconds": round(sum(r["compute_seconds"] for r in report.records), 2),
        "tokens_per_second": round((report.tokens_in + report.tokens_out) / wall, 1),
        "prefix_hit_tokens": sum(r["prefix_hit_tokens"] for r in report.records),
        "per_document": [{k: r[k] for k in ("path", "chunks", "reduce_levels", "tokens_in", "tokens_out", "seconds")}
                         for r in report.records],
    }


@click.command(help=__doc__)
@click.argument("paths", nargs=-1)
@click.option("--workers", "worker_counts", multiple=True, default=("default", "1", "2"), show_default=True,
              help="A worker count to run, or 'default' for the embedded default split (repeatable).")
@click.option("--kv-budget", default="1024tok", show_default=True)
@click.option("--max-summary-tokens", type=int, default=64, show_default=True)
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--json", "json_path", default=None, help="Also write the results here.")
def main(paths: tuple[str, ...], worker_counts: tuple[str, ...], kv_budget: str, max_summary_tokens: int,
         model: str, json_path: str | None) -> None:
    paths = list(paths) or [str(ROOT / "examples")]
    os.environ.pop("REDIS_URL", None)
    results = []
    for n in worker_counts:
        print(f"summarising {', '.join(paths)} with {n} worker(s) ...", file=sys.stderr, flush=True)
        results.append(run_once(paths, workers=None if n == "default" else int(n), kv_budget=kv_budget,
                                max_summary_tokens=max_summary_tokens, model=model))

    print(f"\nmodel {model}, KV budget {kv_budget}, summaries <= {max_summary_tokens} tokens, "
          f"{os.cpu_count()} cores")
    print(f"{'split':>7} {'workers':>7} {'threads':>7} {'docs':>4} {'chunks':>6} {'jobs':>4} {'tok in':>7} {'tok out':>7} "
          f"{'wall s':>7} {'compute s':>9} {'tok/s':>7}")
    for r in results:
        print(f"{r['split']:>7} {r['workers']:>7} {r['threads_per_worker']:>7} {r['documents']:>4} {r['chunks']:>6} {r['jobs']:>4} "
              f"{r['tokens_in']:>7} {r['tokens_out']:>7} {r['wall_seconds']:>7.1f} {r['compute_seconds']:>9.1f} "
              f"{r['tokens_per_second']:>7.1f}   (prompt tokens reused from the KV cache: {r['prefix_hit_tokens']})")
    for r in results[:1]:
        print("\nper document (first run):")
        for d in r["per_document"]:
            print(f"  {Path(d['path']).name:<34} chunks {d['chunks']:>2}  reduce levels {d['reduce_levels']}  "
                  f"tokens {d['tokens_in']:>5} in {d['tokens_out']:>4} out  {d['seconds']:.1f} s")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Pipeline overhead: N short jobs through Redis + one worker vs. the same jobs in a plain engine loop.

    python -m bench.bench_pipeline [--jobs 200] [--max-tokens 8] [--runs 3] [--threads 2]

Both sides run the same prompts in the same order with the same engine settings. The pipeline side
is the whole path: submit_batch (validation, claims, enqueue), a worker process (`python -m
pipeline.cli_worker`, the production command, engine loaded before timing) dequeuing, generating with
token streaming into Redis, recording results and batch events, and the collector writing the
OpenAI Batch output file. Runs alternate plain/pipeline; medians are reported with the overhead ratio
(pipeline / plain - 1; target <= 5 %). Every pipeline run uses recompute so nothing is reused.
Also reported, from the stored results: the worker's time outside the engine (in each job and between
jobs) relative to the engine's own prefill+decode time -- less sensitive to other load on the machine.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click

from engine.engine import Engine
from engine.params import SamplingParams
from pipeline.client import Client
from pipeline.collector import collect
from pipeline.embedded import RedisServer, WorkerProcess, stop_workers, worker_argv

ROOT = Path(__file__).resolve().parent.parent

TOPICS = ["a colour", "a fruit", "an animal", "a planet", "a country", "a tree", "a river", "a metal",
          "a sport", "an ocean", "a vegetable", "an instrument", "a month", "a bird", "a city", "a tool"]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Item {i}: name {TOPICS[i % len(TOPICS)]}."}] for i in range(n)]


def run_plain(eng: Engine, msgs: list[list[dict]], params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    toks = 0
    for m in msgs:
        toks += eng.generate(messages=m, params=params).completion_tokens
    return time.perf_counter() - t0, toks


def worker_side(client: Client, batch_id: str) -> dict[str, float]:
    """Where the worker's time went, from the stored results (robust to other load on the machine):
    engine = prefill + decode as the engine timed them; in_job = the rest of each job's run (streaming
    XADDs, result/announce Lua, chat rendering, tokenizing); between = gaps between consecutive jobs
    (rq bookkeeping, dequeue)."""
    rs = sorted((r for _, r in client.results(batch_id) if r is not None), key=lambda r: r.started_at)
    engine = sum(r.prefill_seconds + r.decode_seconds for r in rs)
    in_job = sum(r.ended_at - r.started_at for r in rs) - engine
    between = sum(max(0.0, b.started_at - a.ended_at) for a, b in zip(rs, rs[1:]))
    return {"engine": engine, "in_job": in_job, "between": between}


def run_pipeline(client: Client, model: str, msgs: list[list[dict]], params: SamplingParams,
                 out: Path) -> tuple[float, float, int, dict[str, float]]:
    jobs = [{"model": model, "messages": m, "params": params.model_dump(), "custom_id": f"r{i}"}
            for i, m in enumerate(msgs)]
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    bid = client.submit_batch(jobs, recompute=True)
    t_submit = time.perf_counter() - t0
    s = collect(client, bid, out, progress=False, block_ms=200)
    wall = time.perf_counter() - t0
    assert s.done == len(jobs), s
    return wall, t_submit, s.generated_tokens, worker_side(client, bid)


@click.command(help=__doc__)
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--jobs", "n_jobs", type=int, default=200, show_default=True)
@click.option("--max-tokens", type=int, default=8, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--threads", type=int, default=os.cpu_count() or 1, show_default=True)
@click.option("--kv-budget", default=None)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary line only.")
def main(model: str, n_jobs: int, max_tokens: int, runs: int, threads: int, kv_budget: str | None,
         as_json: bool) -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below on kill

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    msgs = prompts(n_jobs)
    kw = {"threads": threads}
    if kv_budget:
        kw["kv_budget"] = kv_budget
    eng = Engine(model, **kw)
    eng.generate(messages=msgs[0], params=params)  # warm-up

    server = RedisServer().start()
    tmp = Path(tempfile.mkdtemp(prefix="rqllm-bench-"))
    worker = WorkerProcess(worker_argv(server.url, model, threads=threads, kv_budget=kv_budget,
                                          name="bench-worker", extra=["--log-level", "WARNING"]),
                           str(tmp / "worker.log"))
    client = Client(server.url)
    plain, pipe, submit, sides = [], [], [], []
    try:
        deadline = time.monotonic() + 120
        while not client.connection.exists("rq:worker:bench-worker"):
            if not worker.alive() or time.monotonic() > deadline:
                raise SystemExit("worker did not start:\n" + worker.tail())
            time.sleep(0.1)
        run_pipeline(client, model, msgs[:2], params, tmp / "warm.jsonl")  # warm-up
        for r in range(runs):
            # alternate which side goes first so drifting load on the machine hits both alike
            if r % 2 == 0:
                p, toks_p = run_plain(eng, msgs, params)
                q, sub, toks_q, side = run_pipeline(client, model, msgs, params, tmp / "out.jsonl")
            else:
                q, sub, toks_q, side = run_pipeline(client, model, msgs, params, tmp / "out.jsonl")
                p, toks_p = run_plain(eng, msgs, params)
            plain.append(p)
            pipe.append(q)
            submit.append(sub)
            sides.append(side)
            if not as_json:
                print(f"run {r + 1}: plain {p:.3f} s ({toks_p} tok), pipeline {q:.3f} s ({toks_q} tok, "
                      f"submit {sub * 1000:.0f} ms), overhead {100 * (q / p - 1):+.1f} %; worker: engine "
                      f"{side['engine']:.3f} s, in-job {1000 * side['in_job'] / n_jobs:.2f} ms/job, between "
                      f"jobs {1000 * side['between'] / n_jobs:.2f} ms/job", flush=True)
    finally:
        stop_workers([worker])
        server.stop()
    mp, mq = statistics.median(plain), statistics.median(pipe)
    summary = {
        "jobs": n_jobs, "max_tokens": max_tokens, "runs": runs, "threads": threads,
        "plain_median_s": round(mp, 4), "pipeline_median_s": round(mq, 4),
        "submit_median_ms": round(1000 * statistics.median(submit), 1),
        "overhead_ratio": round(mq / mp - 1, 4),
        "overhead_ms_per_job": round(1000 * (mq - mp) / n_jobs, 3),
        "worker_engine_median_s": round(statistics.median(x["engine"] for x in sides), 4),
        "worker_in_job_ms_per_job": round(1000 * statistics.median(x["in_job"] for x in sides) / n_jobs, 3),
        "worker_between_jobs_ms_per_job": round(1000 * statistics.median(x["between"] for x in sides) / n_jobs, 3),
        "worker_overhead_ratio": round(statistics.median((x["in_job"] + x["between"]) / x["engine"] for x in sides), 4),
    }
    if as_json:
        print(json.dumps(summary))
    else:
        print(f"median plain {mp:.3f} s, median pipeline {mq:.3f} s over {runs} runs of {n_jobs} jobs "
              f"(max_tokens {max_tokens}, {threads} threads)")
        print(f"overhead ratio {100 * summary['overhead_ratio']:+.2f} % "
              f"({summary['overhead_ms_per_job']:.2f} ms/job; target <= 5 %)")
        print(f"worker-side overhead {100 * summary['worker_overhead_ratio']:.2f} % of engine time "
              f"({summary['worker_in_job_ms_per_job']:.2f} ms/job in jobs, "
              f"{summary['worker_between_jobs_ms_per_job']:.2f} ms/job between jobs)")
        print(json.dumps(summary))


if __name__ == "__main__":
    main()

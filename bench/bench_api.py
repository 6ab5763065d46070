"""The HTTP API's overhead: N short chat completions through `rqllm serve` (the official openai client,
C requests in flight) against the same jobs through `rqllm submit --wait` (one batch, the CLI as a user
runs it), on the same Redis and workers.

    python -m bench.bench_api [--requests 200] [--max-tokens 8] [--runs 3] [--workers 2] [--threads 1]
                              [--concurrency 16] [--sequential 20]

Both sides queue the same prompts with the same params; every run gets its own seed (greedy decoding
ignores it, but it is part of the job's content id), so nothing is served from an earlier run's results.
Runs alternate API / submit; medians are reported. The submit side includes the CLI's fixed cost (a new
Python process, validation, collecting), measured apart by submitting a file whose results are all stored.

A sequential phase then sends single requests one at a time: each one's latency minus its job's own run
time in the worker (from the stored result) is the API's per-request overhead (HTTP, validation, the
claim and enqueue, waking the worker, following the token stream, the response).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from jobs import keys
from pipeline.embedded import RedisServer, WorkerProcess, stop_workers, worker_argv
from tests.api_server import ServeProcess
from tests.conftest_redis import wait_for_workers

ROOT = Path(__file__).resolve().parent.parent

MODEL = "smollm2-135m"
KEY = "bench-key"
TOPICS = ["a colour", "a fruit", "an animal", "a planet", "a country", "a tree", "a river", "a metal",
          "a sport", "an ocean", "a vegetable", "an instrument", "a month", "a bird", "a city", "a tool"]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Item {i}: name {TOPICS[i % len(TOPICS)]}."}]


def run_api(client, n: int, max_tokens: int, seed: int, concurrency: int) -> float:
    def one(i: int) -> int:
        r = client.chat.completions.create(model=MODEL, messages=messages(i), max_tokens=max_tokens, seed=seed)
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(n)))
    elapsed = time.perf_counter() - t0
    assert tokens > 0
    return elapsed


def run_submit(redis_url: str, n: int, max_tokens: int, seed: int, workdir: Path, tag: str = "") -> float:
    src = workdir / f"in-{seed}{tag}.jsonl"
    out = workdir / f"out-{seed}{tag}.jsonl"
    with open(src, "w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": MODEL, "messages": messages(i), "max_tokens": max_tokens,
                                         "seed": seed}}) + "\n")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", "submit", str(src), "-o",
                        str(out), "--no-progress", "--redis-url", redis_url], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    elapsed = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr)
    assert sum(1 for _ in open(out)) == n
    return elapsed


def sequential_overhead(client, redis, n: int, max_tokens: int, seed: int) -> list[float]:
    """Per request: client latency minus the job's run time in the worker (seconds)."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=MODEL, messages=messages(1000 + i), max_tokens=max_tokens, seed=seed)
        latency = time.perf_counter() - t0
        result = json.loads(redis.get(keys.result_key(r.id.removeprefix("chatcmpl-"))))
        out.append(latency - (result["ended_at"] - result["started_at"]))
    return out


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--requests", type=int, default=200, show_default=True)
@click.option("--max-tokens", type=int, default=8, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--workers", "n_workers", type=int, default=2, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True, help="Engine threads per worker.")
@click.option("--concurrency", type=int, default=16, show_default=True, help="API requests in flight.")
@click.option("--sequential", type=int, default=20, show_default=True,
              help="Single requests for the per-request overhead.")
def main(requests: int, max_tokens: int, runs: int, n_workers: int, threads: int, concurrency: int,
         sequential: int) -> None:

    from redis import Redis

    workdir = Path(tempfile.mkdtemp(prefix="bench-api-"))
    server = RedisServer().start()
    names = [f"bench-api-w{i}" for i in range(n_workers)]
    workers = [WorkerProcess(worker_argv(server.url, MODEL, threads=threads, name=name),
                             str(workdir / f"{name}.log")) for name in names]
    serve = ServeProcess(workdir / "data", redis_url=server.url, keys=[KEY]).start()
    try:
        redis = Redis.from_url(server.url)
        wait_for_workers(redis, names)
        serve.wait_ready(KEY, models=True)
        client = serve.openai(KEY)
        run_api(client, 8, max_tokens, seed=1, concurrency=4)  # warm-up: first requests, connections
        api, sub = [], []
        for r in range(runs):
            seeds = (100 + 2 * r, 101 + 2 * r)
            order = ("api", "submit") if r % 2 == 0 else ("submit", "api")
            for side, seed in zip(order, seeds):
                if side == "api":
                    api.append(run_api(client, requests, max_tokens, seed, concurrency))
                else:
                    sub.append(run_submit(server.url, requests, max_tokens, seed, workdir))
                print(f"run {r + 1} {side:6s} {(api if side == 'api' else sub)[-1]:7.2f} s", file=sys.stderr)
        # The submit side's fixed cost: the same file again, every result already stored (no generation).
        fixed = statistics.median(run_submit(server.url, requests, max_tokens, 101, workdir, f"-again{i}")
                                  for i in range(3))
        per_request = sequential_overhead(client, redis, sequential, max_tokens, seed=999)
    finally:
        serve.stop()
        stop_workers(workers)
        server.stop()

    a, s = statistics.median(api), statistics.median(sub)
    n = requests
    print(f"{n} chat completions, max_tokens {max_tokens}, {n_workers} worker(s) x {threads} thread(s), "
          f"medians of {runs} runs")
    print(f"  API (openai client, {concurrency} in flight)   {a:7.2f} s   {n / a:6.1f} req/s")
    print(f"  rqllm submit --wait (one batch)     {s:7.2f} s   {n / s:6.1f} req/s"
          f"   (fixed cost: the same file with every result stored {fixed:.2f} s)")
    print(f"  API overhead vs submit: {a - s:+.2f} s ({(a / s - 1) * 100:+.1f} %), "
          f"{(a - s) / n * 1000:+.1f} ms per request; vs submit less its fixed cost: "
          f"{(a / max(1e-9, s - fixed) - 1) * 100:+.1f} %")
    q = sorted(per_request)
    print(f"  one request at a time: latency - job run time = median {statistics.median(q) * 1000:.1f} ms, "
          f"p90 {q[int(0.9 * (len(q) - 1))] * 1000:.1f} ms ({len(q)} requests)")


if __name__ == "__main__":
    main()

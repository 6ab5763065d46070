"""Python overhead per decoded token: the compiled forward loop vs the engine's generate vs the worker path.

    chrt -f 10 python -m bench.bench_decode_overhead [--model smollm2-135m] [--tokens 128] [--runs 7]
                                                    [--threads 2] [--profile]

Three ways to decode the same greedy continuation (same prompt, same tokens, same positions):

* forward: only the compiled forward pass, token after token (Model.forward on the ids the engine
  produced; no sampling, no text) - the floor;
* engine: Engine.generate (sampling, stop checks, streaming detokenisation, should_stop polling);
* worker: jobs.runtime.run_generation, the code a worker runs for a job, in this process against a
  real redis-server: the engine plus the token stream into Redis (XADDs batched every 50 ms), the
  stop/timeout callback and the result recorded at the end (outside the decode time).

Per token: decode time / forwards, for engine and worker from Generation/JobResult.decode_seconds
(the engine's own clock around its decode loop). Overhead = (path - forward) per token, in us and in
% of the forward. Across runs that difference is at the mercy of the load on the machine, so each
engine/worker run also times its own forward calls (a wrapper around Model.forward, ~0.2 us per
call) and reports the rest of its decode time: the Python time per token, measured in-run. Runs are interleaved (forward, engine, worker, ...) on a noisy shared machine;
medians and min-max are printed. --profile adds a cProfile of the worker path's decode, by own time.
Target: Python overhead per token < 5 %.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the engine: keep numpy's pool off the cores

import click

from engine.engine import Engine
from engine.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea, in detail."}]


def forward_only(eng: Engine, prompt_ids: list[int], out_ids: list[int]) -> tuple[float, int]:
    """Seconds and forwards for the decode of out_ids after prompt_ids, compiled forward only."""
    eng.forget_cache()  # the engine's prefix cache is about to be overwritten
    eng.model.forward(prompt_ids, 0)
    n = len(out_ids) - 1  # the engine does not forward its last sampled token
    pos = len(prompt_ids)
    fwd = eng.model.forward
    t0 = time.perf_counter()
    for i in range(n):
        fwd([out_ids[i]], pos + i)
    return time.perf_counter() - t0, n


class ForwardClock:
    """Times the engine's decode forwards (1-token calls) from inside its own run: the decode time
    minus this is the time the path spends outside the compiled forward, measured in the same run
    (immune to the machine's load drifting between runs, unlike comparing separate runs)."""

    def __init__(self, eng: Engine):
        self.model = eng.model
        self.inner = eng.model.forward
        self.seconds = 0.0

    def __enter__(self) -> ForwardClock:
        inner, clock = self.inner, time.perf_counter

        def timed(tokens, pos0):
            if len(tokens) != 1:
                return inner(tokens, pos0)
            t0 = clock()
            out = inner(tokens, pos0)
            self.seconds += clock() - t0
            return out

        self.model.forward = timed  # instance attribute shadows the method for this run
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward


def engine_path(eng: Engine, params: SamplingParams) -> tuple[float, int, list[int], list[int], float]:
    eng.forget_cache()  # no prefix reuse: every run does the same work
    with ForwardClock(eng) as fc:
        gen = eng.generate(messages=PROMPT, params=params)
    return gen.decode_seconds, len(gen.ids) - 1, gen.prompt_ids, gen.ids, gen.decode_seconds - fc.seconds


def worker_path(eng: Engine, params: SamplingParams, connection, run: int) -> tuple[float, int, float]:
    from jobs.runtime import WorkerContext, run_generation, set_context
    from jobs.schemas import TaskOptions
    from jobs.schemas import validate_job

    eng.forget_cache()
    set_context(WorkerContext(engine=eng, connection=connection, worker_name="bench-decode"))
    try:
        job = validate_job({"model": "bench", "messages": PROMPT, "params": params.model_dump(),
                            "custom_id": f"run-{run}"})
        with ForwardClock(eng) as fc:
            result = run_generation(job, TaskOptions())
    finally:
        set_context(None)
    return result.decode_seconds, result.completion_tokens - 1, result.decode_seconds - fc.seconds


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.1f} ({min(xs):.1f}-{max(xs):.1f})"


@click.command()
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--tokens", default=128, show_default=True, help="max_tokens (greedy)")
@click.option("--runs", default=7, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--profile", is_flag=True, help="cProfile one worker-path run and print the top entries.")
def main(model: str, tokens: int, runs: int, threads: int, profile: bool) -> None:
    from pipeline.embedded import RedisServer
    from jobs.redis_conn import connect

    eng = Engine(model, threads=threads)
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    server = RedisServer().start()
    try:
        connection = connect(server.url)
        _, _, prompt_ids, out_ids, _ = engine_path(eng, params)  # warm-up; the continuation all paths decode
        worker_path(eng, params, connection, -1)
        us: dict[str, list[float]] = {"forward": [], "engine": [], "worker": []}
        outside: dict[str, list[float]] = {"engine": [], "worker": []}  # in-run: us/token outside the forward
        share: dict[str, list[float]] = {"engine": [], "worker": []}  # ... in % of the forward time
        for r in range(runs):
            s, n = forward_only(eng, prompt_ids, out_ids)
            us["forward"].append(1e6 * s / n)
            s, n, _, ids, rest = engine_path(eng, params)
            assert ids == out_ids, "greedy decode changed between runs"
            us["engine"].append(1e6 * s / n)
            outside["engine"].append(1e6 * rest / n)
            share["engine"].append(100 * rest / (s - rest))
            s, n, rest = worker_path(eng, params, connection, r)
            us["worker"].append(1e6 * s / n)
            outside["worker"].append(1e6 * rest / n)
            share["worker"].append(100 * rest / (s - rest))
        if profile:
            pr = cProfile.Profile()
            pr.enable()
            worker_path(eng, params, connection, runs)
            pr.disable()
    finally:
        server.stop()

    base = statistics.median(us["forward"])
    print(f"{model}, {threads} threads, greedy, {len(out_ids)} tokens after a {len(prompt_ids)}-token prompt; "
          f"{runs} interleaved runs, per decoded token, median (min-max)")
    print(f"{'path':10}{'us/token':>24}{'tok/s':>9}{'overhead us':>13}{'overhead':>10}")
    for name, xs in us.items():
        m = statistics.median(xs)
        paired = [100 * (x / f - 1) for x, f in zip(xs, us["forward"])]
        extra = "" if name == "forward" else f"{m - base:13.1f}{100 * (m / base - 1):9.2f}%"
        print(f"{name:10}{fmt(xs):>24}{1e6 / m:9.1f}{extra}")
        if name != "forward":
            print(f"{'':10}per-run overhead vs the forward run next to it: median {statistics.median(paired):+.2f} % "
                  f"(min {min(paired):+.2f} %, max {max(paired):+.2f} %)")
    print("in-run split (each run's decode time minus its own forward calls, timed inside the run):")
    for name in ("engine", "worker"):
        print(f"{'':10}{name}: {statistics.median(outside[name]):.1f} us/token outside the compiled forward "
              f"({min(outside[name]):.1f}-{max(outside[name]):.1f}) = {statistics.median(share[name]):.2f} % "
              f"of the forward time ({min(share[name]):.2f}-{max(share[name]):.2f} %)")
    print("target: overhead < 5 %")
    if profile:
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
        print(buf.getvalue())


if __name__ == "__main__":
    main()

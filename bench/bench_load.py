"""Aggregate throughput of one job set run by W worker processes x T engine threads each, on this
machine's C usable CPUs: the splits 1xC and Cx1, the default split, and oversubscribed 2Cx1 and Cx2.

    python -m bench.bench_load --model gemma3-270m [--jobs 8] [--prefill 256] [--decode 32] [--reps 3]
                               [--llama-bench /path/to/llama.cpp/build/bin/llama-bench]

Each worker process loads the model once, waits until every worker has loaded, then runs its share of the
jobs (a job: a fresh prompt of --prefill tokens at position 0, then --decode greedy-free tokens fed
one at a time). A split's figure is the wall time of the whole job set (start to last worker done),
reported as aggregate prefill and decode tok/s (the sum over workers of tokens / their own time in
that phase) and as the ratio of its wall time to the best split's. Oversubscribed splits run twice:
with the adaptive thread governor (the default, engine/thread_governor.py) and without it
(RQLLM_ADAPTIVE_THREADS=0), which is how the engine behaved before.

With --llama-bench, llama.cpp's llama-bench runs the same splits as W concurrent processes with
-t T (its figures: the sum of the processes' avg tok/s for pp and tg; no wall time).
Medians of --reps runs, splits interleaved per repetition (this machine is shared and noisy).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click

from bench.bench_engine import llama_bench_command, model_file, parse_llama_bench_json, prompt_tokens
from engine.cpus import choose_split, usable_cpus

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Split:
    workers: int
    threads: int
    label: str
    adaptive: bool = True

    @property
    def name(self) -> str:
        return f"{self.workers}x{self.threads}" + ("" if self.adaptive else " fixed")


def splits_for(cpus: int) -> list[Split]:
    out = [Split(1, cpus, "1xC"), Split(cpus, 1, "Cx1")]
    out += [Split(2 * cpus, 1, "2Cx1"), Split(cpus, 2, "Cx2"), Split(cpus, 2, "Cx2", adaptive=False)]
    if cpus == 1:  # 1xC and Cx1 coincide
        out = out[1:]
    return out


def worker_main(model: str, threads: int, jobs: int, prefill: int, decode: int) -> None:
    """One worker process: loads, says "ready", waits for a line on stdin, runs its jobs, then prints a
    JSON line with its prefill and decode seconds."""
    from engine.model import Model

    m = Model.load(str(model_file(model)), threads=threads, kv_budget="64MiB")
    toks = prompt_tokens(prefill + decode, m.cfg.n_vocab, None)
    m.forward(toks[:16], 0)  # warm the mapping
    print("ready", flush=True)
    sys.stdin.readline()
    t_pp = t_tg = 0.0
    for _ in range(jobs):
        t0 = time.perf_counter()
        m.forward(toks[:prefill], 0)
        t1 = time.perf_counter()
        for i in range(decode):
            m.forward([toks[prefill + i]], prefill + i)
        t2 = time.perf_counter()
        t_pp += t1 - t0
        t_tg += t2 - t1
    print(json.dumps({"pp_s": t_pp, "tg_s": t_tg}), flush=True)


def run_ours(model: str, split: Split, jobs: int, prefill: int, decode: int) -> dict:
    per = [jobs // split.workers + (1 if i < jobs % split.workers else 0) for i in range(split.workers)]
    env = dict(os.environ, RQLLM_ADAPTIVE_THREADS="1" if split.adaptive else "0")
    procs = [subprocess.Popen([sys.executable, "-m", "bench.bench_load", "--worker", model, str(split.threads), str(n),
                               str(prefill), str(decode)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT)
             for n in per if n > 0]
    for p in procs:  # every worker loaded before the clock starts
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("a worker failed to start")
    start = time.perf_counter()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"worker exited with {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    wall = time.perf_counter() - start
    n_done = [n for n in per if n > 0]
    return {
        "wall": wall,
        "pp": sum(n * prefill / r["pp_s"] for n, r in zip(n_done, results)),
        "tg": sum(n * decode / r["tg_s"] for n, r in zip(n_done, results)),
    }


def run_llama(exe: str, model: str, split: Split, prefill: int, decode: int) -> dict:
    path = model_file(model)
    cmd = llama_bench_command(exe, path, split.threads, prefill, decode)
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(split.workers)]
    pp = tg = 0.0
    for p in procs:
        out, _ = p.communicate()
        a, b = parse_llama_bench_json(out)
        pp += a
        tg += b
    return {"pp": pp, "tg": tg}


@click.command()
@click.option("--model", default="gemma3-270m", show_default=True)
@click.option("--jobs", default=8, show_default=True, help="Jobs in the set (each: prefill + decode).")
@click.option("--prefill", default=256, show_default=True)
@click.option("--decode", default=32, show_default=True)
@click.option("--reps", default=3, show_default=True)
@click.option("--llama-bench", "llama_bench", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--worker", nargs=5, type=str, default=None, hidden=True)
def main(model, jobs, prefill, decode, reps, llama_bench, worker):
    if worker:
        m, t, n, p, d = worker
        worker_main(m, int(t), int(n), int(p), int(d))
        return
    cpus = usable_cpus()
    splits = splits_for(cpus.count)
    default = choose_split(jobs, cpus=cpus, environ={})  # what rqllm summarize / submit --wait would start
    splits = [Split(s.workers, s.threads, s.label + ("=default" if (s.workers, s.threads) == (default.workers,
              default.threads) and s.adaptive else ""), s.adaptive) for s in splits]
    if not any("default" in s.label for s in splits):
        splits.insert(0, Split(default.workers, default.threads, "default"))
    print(f"{cpus.count} usable CPUs ({cpus.reason}); model {model}, {jobs} jobs of pp{prefill} + tg{decode}; "
          f"splits {', '.join(s.name for s in splits)}; the embedded default: {default.workers}x{default.threads}",
          flush=True)
    ours: dict[str, list[dict]] = {s.name: [] for s in splits}
    theirs: dict[str, list[dict]] = {s.name: [] for s in splits if s.adaptive}
    for rep in range(reps):
        for s in splits:
            r = run_ours(model, s, jobs, prefill, decode)
            ours[s.name].append(r)
            line = f"rep {rep + 1}/{reps} {s.name:>9}: ours wall {r['wall']:.2f} s, pp {r['pp']:.0f}, tg {r['tg']:.1f}"
            if llama_bench and s.adaptive:
                q = run_llama(llama_bench, model, s, prefill, decode)
                theirs[s.name].append(q)
                line += f" | llama pp {q['pp']:.0f}, tg {q['tg']:.1f}"
            print(line, flush=True)

    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in ours.items()}
    best = min(med.values(), key=lambda r: r["wall"])["wall"]
    best_pp = max(r["pp"] for r in med.values())
    best_tg = max(r["tg"] for r in med.values())
    print(f"\nmedians of {reps}; 'best/...' = this split against the best split of ours (1.00 = the best)")
    print(f"{'split':>9} {'label':>10} {'wall s':>7} {'pp tok/s':>9} {'tg tok/s':>9} {'best/wall':>9} "
          f"{'pp/best':>8} {'tg/best':>8}" + (f" {'llama pp':>9} {'llama tg':>9}" if llama_bench else ""))
    for s in splits:
        r = med[s.name]
        line = (f"{s.name:>9} {s.label:>10} {r['wall']:7.2f} {r['pp']:9.0f} {r['tg']:9.1f} {best / r['wall']:9.2f} "
                f"{r['pp'] / best_pp:8.2f} {r['tg'] / best_tg:8.2f}")
        if llama_bench and s.name in theirs and theirs[s.name]:
            line += (f" {statistics.median(q['pp'] for q in theirs[s.name]):9.0f}"
                     f" {statistics.median(q['tg'] for q in theirs[s.name]):9.1f}")
        print(line)


if __name__ == "__main__":
    main()

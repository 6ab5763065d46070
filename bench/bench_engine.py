"""Prefill and decode speed of our engine against llama.cpp, measured side by side in one run.

    python bench/bench_engine.py [--model smollm2-135m --model gemma3-270m --model 8b-shape] [--threads 1 --threads 2]
                                 [--reps 5] [--prefill N] [--decode N]

`8b-shape` is the synthetic Llama-3-8B-shape Q4_K_M model, generated into the cache on first use
(bench/shape_8b.py, ~4.5 GB, ~15 s).  Prefill/decode lengths default per model: pp64/tg16 for
8b-shape (the issue's peer figures for it), pp128/tg64 for the others; --prefill/--decode override.

llama.cpp runs through llama-cpp-python (pip install llama-cpp-python), timed around its eval
calls only (its perf counters read zero through the binding). Runs are interleaved (ours, theirs, ours,
...) because this machine is shared and noisy; medians and ratios are printed.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

# numpy's OpenBLAS threads (unused here) spin on the cores the engine's OpenMP threads need;
# must be set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import models  # noqa: E402
from engine.model import Model  # noqa: E402


SHAPE_8B = "8b-shape"
DEFAULT_LENGTHS = {SHAPE_8B: (64, 16)}  # (prefill, decode) per model
OTHER_LENGTHS = (128, 64)


def model_file(name: str) -> Path:
    if name == SHAPE_8B:
        from shape_8b import ensure  # bench/ is on sys.path when this runs as a script

        return ensure(log=lambda m: print(m, file=sys.stderr))
    return models.resolve(name)


def prompt_tokens(n: int, vocab: int, bos: int | None, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    toks = [int(t) for t in rng.integers(100, min(vocab, 30000), size=n)]
    if bos is not None:
        toks[0] = bos
    return toks


def bench_ours(model: Model, toks: list[int], n_decode: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    logits = model.forward(toks, 0)
    t1 = time.perf_counter()
    tok = int(np.argmax(logits))
    for i in range(n_decode):
        logits = model.forward([tok], len(toks) + i)
        tok = int(np.argmax(logits))
    t2 = time.perf_counter()
    return len(toks) / (t1 - t0), n_decode / (t2 - t1)


class LlamaCpp:
    def __init__(self, path: Path, threads: int, n_ctx: int):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, n_ubatch=512, no_perf=False, verbose=False)

    def bench(self, toks: list[int], n_decode: int) -> tuple[float, float]:
        return peer_run(self.llm, toks, n_decode)


def peer_run(llm, toks: list[int], n_decode: int) -> tuple[float, float]:
    """Prefill and decode tok/s of a llama_cpp.Llama, from a cleared cache."""
    llm.reset()
    llm._ctx.kv_cache_clear()  # positions restart at 0: the old sequence must go
    # Wall clock around eval: llama.cpp's perf counters read zero through this binding; the
    # binding's own overhead is tens of microseconds per call against milliseconds of compute.
    t0 = time.perf_counter()
    llm.eval(toks)
    t1 = time.perf_counter()
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t_decode = 0.0
    for _ in range(n_decode):
        ta = time.perf_counter()
        llm.eval([tok])
        t_decode += time.perf_counter() - ta
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return len(toks) / (t1 - t0), n_decode / t_decode


def spread(runs: list[tuple[float, float]], i: int) -> float:
    values = [r[i] for r in runs]
    return max(values) / min(values) - 1


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@click.command()
@click.option("--model", "model_names", multiple=True, default=("smollm2-135m", "gemma3-270m"))
@click.option("--threads", "thread_counts", multiple=True, type=int, default=(1, 2))
@click.option("--reps", type=int, default=5)
@click.option("--prefill", "prefill_arg", type=int, default=None, help="Prompt tokens (default per model).")
@click.option("--decode", "decode_arg", type=int, default=None, help="Decoded tokens (default per model).")
@click.option("--no-peer", is_flag=True, help="Skip llama.cpp.")
def main(model_names, thread_counts, reps, prefill_arg, decode_arg, no_peer):
    try:
        import llama_cpp  # noqa: F401
        have_peer = not no_peer
    except ImportError:
        have_peer = False
        print("llama-cpp-python not installed: printing our figures only", file=sys.stderr)
    rows = []
    for name in model_names:
        path = model_file(name)
        n_prefill, n_decode = DEFAULT_LENGTHS.get(name, OTHER_LENGTHS)
        n_prefill, n_decode = prefill_arg or n_prefill, decode_arg or n_decode
        for threads in thread_counts:
            ours = Model.load(path, threads=threads, kv_budget="256MiB", max_context=n_prefill + n_decode + 8)
            cfg = ours.cfg
            bos = ours.gguf.get("tokenizer.ggml.bos_token_id")
            toks = prompt_tokens(n_prefill, cfg.n_vocab, bos)
            peer = LlamaCpp(path, threads, n_prefill + n_decode + 8) if have_peer else None
            bench_ours(ours, toks[:16], 4)  # warm caches and page in the weights
            if peer:
                peer.bench(toks[:16], 4)
            r_ours, r_peer = [], []
            for _ in range(reps):
                r_ours.append(bench_ours(ours, toks, n_decode))
                if peer:
                    r_peer.append(peer.bench(toks, n_decode))
            pp = statistics.median(r[0] for r in r_ours)
            tg = statistics.median(r[1] for r in r_ours)
            row = {"model": name, "threads": threads, "lengths": f"pp{n_prefill}/tg{n_decode}", "pp": pp, "tg": tg}
            row["spread"] = [spread(r_ours, 0), spread(r_ours, 1)]
            if peer:
                row["peer_pp"] = statistics.median(r[0] for r in r_peer)
                row["peer_tg"] = statistics.median(r[1] for r in r_peer)
                row["spread"] += [spread(r_peer, 0), spread(r_peer, 1)]
            rows.append(row)
            del ours, peer
    print(f"\nprefill / decode tok/s; medians of {reps} interleaved runs")
    header = f"{'model':<14} {'thr':>3} {'lengths':>11} {'ours pp':>9} {'ours tg':>9}"
    if have_peer:
        header += f" {'llama pp':>9} {'llama tg':>9} {'pp ratio':>9} {'tg ratio':>9}"
    print(header)
    for r in rows:
        line = f"{r['model']:<14} {r['threads']:>3} {r['lengths']:>11} {r['pp']:>9.1f} {r['tg']:>9.1f}"
        if "peer_pp" in r:
            line += (f" {r['peer_pp']:>9.1f} {r['peer_tg']:>9.1f} {r['pp'] / r['peer_pp']:>8.2f}x"
                     f" {r['tg'] / r['peer_tg']:>8.2f}x")
        print(line)
    print("spread of the runs (max/min - 1), in the same column order:")
    for r in rows:
        print(f"  {r['model']:<14} {r['threads']:>3} " + " ".join(f"{x:>5.0%}" for x in r["spread"]))
    print(f"peak RSS of this process (both engines): {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    main()

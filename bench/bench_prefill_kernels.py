"""Prefill matmul kernels alone: GMAC/s of rq_matmul on the weight shapes of SmolLM2-135M and
Gemma 3 270M, random weights, 128 tokens, one thread by default.

    python -m bench.bench_prefill_kernels [--model smollm2|gemma3] [--tokens 128] [--threads 1]
                                          [--rounds 5] [--path avx2]

This machine is shared: each figure is the best of --rounds timings (each the mean of --reps
calls), which tracks the kernel rather than the neighbours' load.
"""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click
import numpy as np
from gguf import GGMLQuantizationType as T

from engine.kernels import _kernels as q
from tests import quant_pack as qp

ROOT = Path(__file__).resolve().parents[1]

# (type, rows, cols) of the matmuls of one layer
SHAPES = {
    "smollm2": [(T.Q4_1, 576, 576), (T.Q4_1, 192, 576), (T.Q4_1, 1536, 576), (T.Q4_1, 576, 1536)],
    "gemma3": [(T.Q5_0, 1024, 640), (T.Q5_0, 256, 640), (T.Q8_0, 256, 640), (T.Q4_K, 640, 1024),
               (T.Q5_0, 2048, 640), (T.Q4_K, 640, 2048), (T.Q6_K, 640, 2048)],
}


@click.command()
@click.option("--model", "models", multiple=True, default=tuple(SHAPES))
@click.option("--tokens", type=int, default=128)
@click.option("--threads", type=int, default=1)
@click.option("--rounds", type=int, default=5)
@click.option("--reps", type=int, default=10)
@click.option("--path", default="avx2")
def main(models, tokens, threads, rounds, reps, path):
    rng = np.random.default_rng(0)
    print(f"{'model':<8} {'type':<5} {'rows x cols':>12} {'ms':>8} {'GMAC/s':>8}   ({tokens} tokens, {threads} thread(s), {path})")
    for name in models:
        for t, rows, cols in SHAPES[name]:
            W = qp.random_rows(t, rows, cols, rng)
            X = rng.standard_normal((tokens, cols)).astype(np.float32)
            best = min(q.bench_matmul(int(t), W, rows, cols, X, nthreads=threads, reps=reps, path=path)
                       for _ in range(rounds))
            print(f"{name:<8} {T(t).name:<5} {f'{rows}x{cols}':>12} {best * 1e3:8.3f} {rows * cols * tokens / best / 1e9:8.1f}")


if __name__ == "__main__":
    main()

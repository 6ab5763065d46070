"""One-token matmuls streamed from DRAM under each decode candidate, kernels and prefetch (engine/decode_tuning.py).

    python -m bench.bench_decode_prefetch [--types Q4_K,Q6_K,Q8_0] [--threads 1] [--kernel avx512] [--reps 3]

A 32768 x 4096 matrix of each type (random bytes; 75-140 MB, far past the L3) is repacked to R16 and
multiplied by one token under every candidate setting, interleaved; GB/s of weights read (medians),
and the GGUF layout's own kernel for comparison. The setting the engine would pick at load is the
fastest of these on the model's own largest matrix.
"""
from __future__ import annotations

import statistics

import click
import numpy as np


@click.command()
@click.option("--types", default="Q4_K,Q6_K,Q8_0", show_default=True, help="Comma-separated weight types.")
@click.option("--threads", default=1, show_default=True)
@click.option("--kernel", default="avx512", show_default=True, help="Kernel path: avx512 or avx2.")
@click.option("--reps", default=3, show_default=True)
@click.option("--rows", default=32768, show_default=True)
@click.option("--cols", default=4096, show_default=True)
def main(types: str, threads: int, kernel: str, reps: int, rows: int, cols: int) -> None:
    from gguf import GGMLQuantizationType as T

    from engine import decode_tuning
    from engine.kernels import _kernels as q

    if not q.cpu_supports(kernel):
        raise click.UsageError(f"this CPU cannot run the {kernel} path")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    before, mode = q.r16_set_prefetch(0), q.set_decode_mode("r16")
    try:
        for name in types.split(","):
            t = int(T[name])
            if not q.r16_supported(t):
                click.echo(f"{name}: no R16 layout")
                continue
            nbytes = rows * q.row_bytes(t, cols)
            w = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
            r = np.zeros(q.r16_bytes(t, rows, cols), dtype=np.uint8)
            q.r16_repack(t, w, rows, cols, r, 0, (rows + 15) // 16, 2)
            rates: dict[str, list[float]] = {}
            for _ in range(reps):
                for c in decode_tuning.candidates(kernel):
                    c.apply()
                    s = (q.bench_matmul(t, w, rows, cols, x, threads, 2, kernel) if c.kernels == "gguf"
                         else q.matmul_r16(t, w, r, rows, cols, x, threads, kernel, 2))
                    rates.setdefault(str(c), []).append(nbytes / s)
            cells = ", ".join(f"{k}: {statistics.median(v) / 1e9:.1f}" for k, v in rates.items())
            click.echo(f"{name} {nbytes / 1e6:.0f} MB, {threads} thread(s), {kernel}, GB/s: {cells}")
    finally:
        q.r16_set_prefetch(*before)
        q.set_decode_mode(mode)


if __name__ == "__main__":
    main()

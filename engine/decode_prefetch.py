"""Whether one-token passes prefetch repacked weights ahead of the kernels: chosen by measurement.

A decode pass streams every weight matrix from memory once. The R16 kernels can ask for each
group's units some way ahead (software prefetch). Where the hardware prefetcher already keeps up,
the extra requests only compete with it: on an AMD EPYC Zen 4 (2 threads, one-token matmuls from
DRAM) prefetching 6 KB ahead streamed Q4_K at 17 GB/s and Q6_K at 12 GB/s, without it at 21 and
16 GB/s. On the Zen 5 machines the kernels were tuned on, it helped. So it is not chosen by CPU
name: at load, the engine times one-token matmuls of the model's own largest repacked matrix both
ways (alternating, after a warm-up that pages it in) and keeps the faster. Results are the same bit
for bit either way; only the speed differs.

RQLLM_DECODE_PREFETCH=<bytes> (0: off) skips the measurement.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

ENV = "RQLLM_DECODE_PREFETCH"
AHEAD = 6144  # the kernels' distance when prefetching (bytes: about two Q4_K units of a group)
CANDIDATES = (0, AHEAD)
ROUNDS = 3


@dataclass(frozen=True)
class PrefetchChoice:
    distance: int  # bytes; 0 = off
    reason: str

    def describe(self) -> str:
        return f"decode prefetch {'off' if self.distance == 0 else f'{self.distance} B ahead'} ({self.reason})"


def choose(matrix: tuple[int, np.ndarray, np.ndarray, int, int] | None, threads: int) -> PrefetchChoice:
    """Set the kernels' prefetch distance and say why. matrix: (type, GGUF bytes, R16 bytes, rows, cols)
    of the model's largest repacked matrix, or None (nothing repacked: nothing to choose)."""
    from engine.kernels import _quants as q

    forced = os.environ.get(ENV)
    if forced is not None:
        try:
            distance = int(forced)
            if distance < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{ENV} must be a number of bytes >= 0, not {forced!r}") from None
        q.r16_set_prefetch(distance)
        return PrefetchChoice(distance, f"{ENV}")
    if matrix is None:
        return PrefetchChoice(AHEAD, "nothing repacked")
    t, w, r, rows, cols = matrix
    x = np.random.default_rng(0).standard_normal((1, cols)).astype(np.float32)
    q.r16_set_prefetch(AHEAD)
    q.matmul_r16(t, w, r, rows, cols, x, threads, None, 1)  # warm-up: pages the matrix in
    seconds: dict[int, list[float]] = {d: [] for d in CANDIDATES}
    for _ in range(ROUNDS):
        for d in CANDIDATES:
            q.r16_set_prefetch(d)
            seconds[d].append(q.matmul_r16(t, w, r, rows, cols, x, threads, None, 1))  # seconds of one call
    best = {d: min(s) for d, s in seconds.items()}
    distance = min(CANDIDATES, key=lambda d: best[d])
    q.r16_set_prefetch(distance)
    gbs = ", ".join(f"{'off' if d == 0 else d}: {r.nbytes / best[d] / 1e9:.1f} GB/s" for d in CANDIDATES)
    return PrefetchChoice(distance, f"measured on a {r.nbytes / 1e6:.0f} MB matrix, {threads} threads: {gbs}")

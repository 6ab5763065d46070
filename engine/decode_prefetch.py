"""How one-token passes prefetch repacked weights ahead of the kernels: chosen by measurement.

A decode pass streams every weight matrix from memory once. The R16 kernels can ask for each
group's units some way ahead (software prefetch), into L1 or L2. What helps depends on the CPU's
own prefetchers: on the Zen 5 machines the kernels were tuned on, 6 KB ahead into L1 did; on an AMD
EPYC Zen 4 (one thread, one-token matmuls from DRAM) that setting streamed Q4_K at 15 GB/s and Q6_K
at 7, no prefetch at 18 and 11, and into L2 6-24 KB ahead at 21 and 16. So it is not chosen by CPU
name: at load, the engine times one-token matmuls of the model's own largest repacked matrix under
each candidate (in rounds, after a warm-up that pages it in) and keeps the fastest. Results are the
same bit for bit whichever it is; only the speed differs.

RQLLM_DECODE_PREFETCH skips the measurement: "off", or "<bytes>" (into L1) or "<bytes>:l2".
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

ENV = "RQLLM_DECODE_PREFETCH"
ROUNDS = 3


@dataclass(frozen=True)
class Prefetch:
    distance: int  # bytes ahead; 0 = off
    to_l2: bool = False

    def __str__(self) -> str:
        return "off" if self.distance == 0 else f"{self.distance} B ahead into {'L2' if self.to_l2 else 'L1'}"

    def apply(self) -> None:
        from engine.kernels import _kernels as q

        q.r16_set_prefetch(self.distance, self.to_l2)


OFF = Prefetch(0)
TUNED_ZEN5 = Prefetch(6144)  # the kernels' setting before it was measured per machine
CANDIDATES = (OFF, TUNED_ZEN5, Prefetch(6144, True), Prefetch(24576, True))


@dataclass(frozen=True)
class PrefetchChoice:
    prefetch: Prefetch
    reason: str

    def describe(self) -> str:
        return f"decode prefetch {self.prefetch} ({self.reason})"


def parse(text: str) -> Prefetch:
    """RQLLM_DECODE_PREFETCH's value: "off", "<bytes>" or "<bytes>:l2"."""
    value = text.strip().lower()
    if value in ("off", "0"):
        return OFF
    number, _, where = value.partition(":")
    if number.isdigit() and where in ("", "l1", "l2"):
        return Prefetch(int(number), where == "l2")
    raise ValueError(f"{ENV} must be off, <bytes> or <bytes>:l2, not {text!r}")


def choose(matrix: tuple[int, np.ndarray, np.ndarray, int, int] | None, threads: int) -> PrefetchChoice:
    """Set the kernels' prefetch and say why. matrix: (type, GGUF bytes, R16 bytes, rows, cols) of
    the model's largest repacked matrix, or None (nothing repacked: nothing to choose)."""
    from engine.kernels import _kernels as q

    forced = os.environ.get(ENV)
    if forced is not None:
        choice = PrefetchChoice(parse(forced), ENV)
    elif matrix is None:
        choice = PrefetchChoice(TUNED_ZEN5, "nothing repacked")
    else:
        t, w, r, rows, cols = matrix
        x = np.random.default_rng(0).standard_normal((1, cols)).astype(np.float32)
        TUNED_ZEN5.apply()
        q.matmul_r16(t, w, r, rows, cols, x, threads, None, 1)  # warm-up: pages the matrix in
        seconds: dict[Prefetch, list[float]] = {c: [] for c in CANDIDATES}
        for _ in range(ROUNDS):
            for c in CANDIDATES:
                c.apply()
                seconds[c].append(q.matmul_r16(t, w, r, rows, cols, x, threads, None, 1))  # one call's seconds
        best = {c: min(s) for c, s in seconds.items()}
        fastest = min(CANDIDATES, key=lambda c: best[c])
        rates = ", ".join(f"{c}: {r.nbytes / best[c] / 1e9:.1f}" for c in CANDIDATES)
        choice = PrefetchChoice(fastest, f"measured on a {r.nbytes / 1e6:.0f} MB matrix, {threads} threads, "
                                         f"GB/s {rates}")
    choice.prefetch.apply()
    return choice

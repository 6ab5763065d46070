"""How one-token passes run over repacked weights: kernels and prefetch, chosen by measurement.

A decode pass streams every weight matrix once, and what is fastest depends on the CPU and on the
thread count, not on its name:
- Kernels. The R16 copies can be read by the path's own kernels (AVX-512 on the avx512 path), by
  the AVX2 R16 kernels (a core that splits 512-bit operations, or one that is compute-bound at the
  worker's thread count, may stream faster with them), or skipped for the GGUF layout.
- Prefetch. The R16 kernels can ask for each group's units some way ahead, into L1 or L2. On the
  Zen 5 machines the kernels were tuned on, 6 KB ahead into L1 helped; on an AMD EPYC Zen 4 (one
  thread, one-token matmuls from DRAM) that setting streamed Q4_K at 15 GB/s and Q6_K at 7, no
  prefetch at 18 and 11, and into L2 6-24 KB ahead at 21 and 16.
So at load the engine times one-token matmuls of the model's own largest repacked matrix under each
candidate (in rounds, after a warm-up that pages it in), with the worker's threads, and keeps the
fastest. Results are the same bit for bit whichever it is; only the speed differs.

RQLLM_DECODE_KERNELS ("r16", "r16-256", "gguf") and RQLLM_DECODE_PREFETCH ("off", "<bytes>" into
L1, "<bytes>:l2") each fix their half of the choice; the other half is still measured.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

ENV = "RQLLM_DECODE_PREFETCH"
ENV_KERNELS = "RQLLM_DECODE_KERNELS"
ROUNDS = 3
KERNELS = ("r16", "r16-256", "gguf")  # _quants.DECODE_MODES


@dataclass(frozen=True)
class Prefetch:
    distance: int  # bytes ahead; 0 = off
    to_l2: bool = False

    def __str__(self) -> str:
        return "off" if self.distance == 0 else f"{self.distance} B ahead into {'L2' if self.to_l2 else 'L1'}"


OFF = Prefetch(0)
TUNED_ZEN5 = Prefetch(6144)  # the kernels' setting before it was measured per machine
PREFETCHES = (OFF, TUNED_ZEN5, Prefetch(6144, True), Prefetch(24576, True))


@dataclass(frozen=True)
class Decode:
    """One way to run the one-token passes: which kernels read the weights, and the R16 prefetch."""
    kernels: str
    prefetch: Prefetch = TUNED_ZEN5

    def __str__(self) -> str:
        return "gguf layout" if self.kernels == "gguf" else f"{self.kernels} kernels, prefetch {self.prefetch}"

    def apply(self) -> None:
        from engine.kernels import _quants as q

        q.set_decode_mode(self.kernels)
        q.r16_set_prefetch(self.prefetch.distance, self.prefetch.to_l2)


@dataclass(frozen=True)
class DecodeChoice:
    decode: Decode
    reason: str

    def describe(self) -> str:
        return f"decode {self.decode} ({self.reason})"


def parse(text: str) -> Prefetch:
    """RQLLM_DECODE_PREFETCH's value: "off", "<bytes>" or "<bytes>:l2"."""
    value = text.strip().lower()
    if value in ("off", "0"):
        return OFF
    number, _, where = value.partition(":")
    if number.isdigit() and where in ("", "l1", "l2"):
        return Prefetch(int(number), where == "l2")
    raise ValueError(f"{ENV} must be off, <bytes> or <bytes>:l2, not {text!r}")


def parse_kernels(text: str) -> str:
    value = text.strip().lower()
    if value not in KERNELS:
        raise ValueError(f"{ENV_KERNELS} must be one of {', '.join(KERNELS)}, not {text!r}")
    return value


def candidates(path: str) -> list[Decode]:
    """Every way to run decode on kernel path `path`: the AVX2 R16 kernels are a separate candidate
    only on the avx512 path; the GGUF layout does not prefetch."""
    kernels = ["r16", "r16-256"] if path == "avx512" else ["r16"]
    return [Decode(k, p) for k in kernels for p in PREFETCHES] + [Decode("gguf", OFF)]


def _narrowed(path: str, environ) -> tuple[list[Decode], list[str]]:
    """The candidates the environment leaves, and the variables that narrowed them."""
    cands, used = candidates(path), []
    if environ.get(ENV_KERNELS) is not None:
        kernels = parse_kernels(environ[ENV_KERNELS])
        if kernels == "r16-256" and path != "avx512":
            kernels = "r16"  # the AVX2 path's R16 kernels are the 256-bit ones
        cands = [c for c in cands if c.kernels == kernels]
        used.append(ENV_KERNELS)
    if environ.get(ENV) is not None:
        prefetch = parse(environ[ENV])
        # a prefetch is for the R16 kernels; with the GGUF layout asked for as well it is moot
        cands = list(dict.fromkeys(Decode(c.kernels, prefetch) for c in cands if c.kernels != "gguf")) or cands
        used.append(ENV)
    return cands, used


def choose(matrix: tuple[int, np.ndarray, np.ndarray, int, int] | None, threads: int,
           environ=None) -> DecodeChoice:
    """Set the decode kernels and prefetch and say why. matrix: (type, GGUF bytes, R16 bytes, rows,
    cols) of the model's largest repacked matrix, or None (nothing repacked: nothing to choose)."""
    from engine.kernels import _quants as q

    environ = os.environ if environ is None else environ
    cands, forced = _narrowed(q.kernel_path(), environ)
    if matrix is None:
        choice = DecodeChoice(Decode("r16", TUNED_ZEN5), "nothing repacked")
    elif len(cands) == 1:
        choice = DecodeChoice(cands[0], ", ".join(forced))
    else:
        t, w, r, rows, cols = matrix
        x = np.random.default_rng(0).standard_normal((1, cols)).astype(np.float32)

        def seconds(c: Decode) -> float:
            c.apply()
            if c.kernels == "gguf":
                return q.bench_matmul(t, w, rows, cols, x, threads, 1)
            return q.matmul_r16(t, w, r, rows, cols, x, threads, None, 1)  # one call's seconds

        seconds(cands[0])  # warm-up: pages the matrix in
        times: dict[Decode, list[float]] = {c: [] for c in cands}
        for _ in range(ROUNDS):
            for c in cands:
                times[c].append(seconds(c))
        best = {c: min(s) for c, s in times.items()}
        fastest = min(cands, key=lambda c: best[c])
        rates = ", ".join(f"{c}: {r.nbytes / best[c] / 1e9:.1f}" for c in cands)
        by = f"; {', '.join(forced)} set" if forced else ""
        choice = DecodeChoice(fastest, f"measured on a {r.nbytes / 1e6:.0f} MB matrix, {threads} threads, "
                                       f"GB/s {rates}{by}")
    choice.decode.apply()
    return choice

"""The one-token matmul where compute binds: weights small enough to stay in cache (a few MB), one
thread, so memory cannot be what limits it. Ours on each kernel path and layout against llama.cpp's
own kernels (ggml's mul_mat through ctypes, bench/ggml_matvec.py) on the same bytes, in one run.

    python -m bench.bench_decode_compute [--type Q4_K ...] [--rows 1024 --cols 2048] [--rounds 7]
                                         [--ggml-lib DIR]   (default: $LLAMA_CPP_LIB_PATH)

Each figure is weight bytes read per second per core (GB/s) and per cycle (B/cycle, at the clock
--ghz, default the kernel's reported MHz), the median of --rounds rounds; within a round every
candidate runs once, interleaved. Ours includes quantising the activation column, as ggml's does.
ggml runs from its plain buffer (its vec_dot kernels) and, for the types llama-bench repacks on x86,
from CPU_REPACK; the ratio is against the faster of the two.

The R16 kernels run with their prefetch off unless --prefetch says otherwise: it asks for each unit
a few KB ahead of a stream from DRAM, and here the weights are already in cache, so it would only
add instructions. A decode pass uses what engine.decode_tuning measures fastest on the machine, and
off is among its choices.
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from engine import decode_tuning  # noqa: E402
from bench.ggml_matvec import REPACKED_ON_X86, Ggml, MatVec  # noqa: E402
from engine.kernels import _kernels as q  # noqa: E402
from tests import quant_pack as qp  # noqa: E402

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0", "IQ4_NL", "IQ4_XS")


def _clock_ghz() -> float:
    """The kernel's reported clock of core 0 (a VM reports the nominal one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1000
    except OSError:
        pass
    return 0.0


def _our_candidates(t: int, W: np.ndarray, rows: int, cols: int, x: np.ndarray):
    """(label, seconds-per-call function) for each path and layout this CPU runs."""
    out = []
    R = None
    if q.r16_supported(t):
        R = np.zeros(q.r16_bytes(t, rows, cols), dtype=np.uint8)
        q.r16_repack(t, W, rows, cols, R, 0, (rows + 15) // 16)
    for path in ("avx2", "avx512"):
        if not q.cpu_supports(path):
            continue
        out.append((f"{path}", lambda reps, path=path: q.bench_matmul(t, W, rows, cols, x, reps=reps, path=path)))
        if R is not None:
            out.append((f"{path}+R16", lambda reps, path=path: q.matmul_r16(t, W, R, rows, cols, x, path=path, reps=reps)))
    return out


def _quantize_seconds(x: np.ndarray, reps: int, path: str) -> float:
    return q.bench_quantize(x.reshape(1, -1), reps=reps, path=path)


@click.command()
@click.option("--type", "types", multiple=True, type=click.Choice(TYPES), default=TYPES)
@click.option("--rows", type=int, default=1024)
@click.option("--cols", type=int, default=2048)
@click.option("--rounds", type=int, default=7)
@click.option("--target-ms", type=float, default=40.0, help="time per candidate per round")
@click.option("--ggml-lib", default=lambda: os.environ.get("LLAMA_CPP_LIB_PATH", ""),
              help="a llama.cpp build's directory of libggml*.so")
@click.option("--ghz", type=float, default=0.0, help="clock for B/cycle (default: /proc/cpuinfo)")
@click.option("--prefetch", default="off", help='R16 prefetch, as RQLLM_DECODE_PREFETCH: "off", "<bytes>", "<bytes>:l2"')
def main(types, rows, cols, rounds, target_ms, ggml_lib, ghz, prefetch):
    if not ggml_lib:
        raise click.UsageError("no llama.cpp build: pass --ggml-lib DIR or set LLAMA_CPP_LIB_PATH")
    pf = decode_tuning.parse(prefetch)
    q.r16_set_prefetch(pf.distance, pf.to_l2)
    g = Ggml(ggml_lib)
    ghz = ghz or _clock_ghz()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(cols).astype(np.float32)
    print(f"one-token matmul, {rows} x {cols}, 1 thread, cache-resident; GB/s of weights "
          f"(B/cycle at {ghz:.2f} GHz), medians of {rounds} rounds; R16 prefetch {pf}")
    for name in types:
        t = int(T[name])
        W = qp.random_rows(t, rows, cols, rng)
        nbytes = W.nbytes
        peers = [("ggml", MatVec(g, t, W, rows, cols, x, repack=False))]
        if t in REPACKED_ON_X86 and rows % 8 == 0:
            peers.append(("ggml-repack", MatVec(g, t, W, rows, cols, x, repack=True)))
        cands = [(label, (lambda reps, m=m: m.seconds(reps))) for label, m in peers]
        cands += _our_candidates(t, W, rows, cols, x)
        # reps per call so that one candidate's timing lasts about target_ms
        reps = {label: max(3, int(target_ms / 1e3 / max(fn(3), 1e-7))) for label, fn in cands}
        times: dict[str, list[float]] = {label: [] for label, _ in cands}
        for _ in range(rounds):
            for label, fn in cands:
                s = fn(reps[label])
                if not label.startswith("ggml"):
                    path = label.split("+")[0]
                    s += _quantize_seconds(x, reps[label], path)
                times[label].append(s)
        med = {label: statistics.median(v) for label, v in times.items()}
        peer = min(med[label] for label, _ in peers)
        cells = []
        for label, _ in cands:
            gbs = nbytes / med[label] / 1e9
            cyc = f" {gbs / ghz:4.1f}" if ghz else ""
            ratio = "" if label.startswith("ggml") else f" {peer / med[label]:4.2f}x"
            cells.append(f"{label} {gbs:5.1f}{cyc}{ratio}")
        print(f"{name:<7} {nbytes / 1e6:5.2f} MB | " + " | ".join(cells), flush=True)
        for _, m in peers:
            m.close()


if __name__ == "__main__":
    main()

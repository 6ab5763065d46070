"""Prefill and decode speed of our engine against llama.cpp and ik_llama.cpp, measured side by side in one run.

    python -m bench.bench_engine --model 1.5b-shape --threads 2 \\
        --llama-bench /path/to/llama.cpp/build/bin/llama-bench --ik-bench /path/to/ik_llama.cpp/build/bin/llama-bench
    python -m bench.bench_engine [--model smollm2-135m --model 8b-shape ...] [--threads 1 --threads 2] [--reps 5]
                                 [--prefill N] [--decode N] [--kernel avx2] [--peer-python] [--no-peer]

Models: a known model name (engine.registry), or a named shape from bench/shapes.py (`8b-shape`,
`1.5b-shape`: random-weight Q4_K_M files with real models' shapes, generated into the cache on first
use; also `qwen3-4b-shape`, `llama3.2-3b-shape`, and `moe-shape`: Qwen3-30B-A3B's layers, 12 of its 48).
Prefill/decode lengths default per model: pp256/tg16 for 8b-shape, qwen3-4b-shape, llama3.2-3b-shape and moe-shape, pp256/tg32 for 1.5b-shape, pp256/tg64 for the
others; --prefill/--decode override.

Peers, each optional:
* `--llama-bench PATH`: llama.cpp's llama-bench binary, run as a subprocess per repetition with
  `-m FILE -p N -n M -t THREADS -r 1 -o json -ngl 0` (its own warm-up run included, not timed);
  tokens/s are its `avg_ts` (prompt test: n_prompt > 0, n_gen = 0; generation test the other way,
  from an empty cache: ours decodes from position 0 too).
* `--ik-bench PATH`: ik_llama.cpp's llama-bench, run the same way twice per repetition, without and
  with `-rtr 1` (run-time repacking of the weights); per figure (pp, tg) the table shows the better
  of the two medians and says which ("plain" or "rtr"). Its fused MoE op (`-fmoe 1`) is its default,
  so a mixture of experts runs with its best MoE settings in both.
* llama-cpp-python (`pip install llama-cpp-python`), in-process, timed around its eval calls (its
  perf counters read zero through the binding): with `--peer-python`, or by default when neither
  binary is given and the module is importable (the behaviour before the binaries existed).
* `--no-peer`: ours only.
Neither binary is built by this project; the README's Benchmarks section says how to build them.

Each engine first runs one untimed warm-up at the full prompt length.  Runs are interleaved per repetition (ours, llama-bench, ik, ik -rtr, llama-cpp-python, ours, ...)
because this machine is shared and noisy; one table of medians and ratios (ours / peer) is printed
at the end, then the paired ratios (the median over reps of ours / that rep's peer run: steadier than
the ratio of medians when the host's memory bandwidth changes state between runs) and the spreads.  Ours runs in this process on the kernel path printed in
the table (RQLLM_KERNEL forces one; --kernel sets RQLLM_KERNEL for our runs).

Fresh pages (default; --keep-pages turns it off): before each run, the weight files that engine reads
are dropped from the page cache (POSIX_FADV_DONTNEED) and read through again, and ours is loaded again,
so every run has its weights in newly placed memory. On the VM this was developed on, decode speed
depends on where the weights land in the host's memory, and that is fixed when they are read: the
same build decoded the 1.5B shape at 44 or 57 tok/s after alternate re-reads of its cache file,
steady within each. ik's -rtr copies its weights into fresh memory on every run, so it drew anew each
rep while a page-cache copy (ours, llama.cpp's mmap) drew once for the whole benchmark; now every
engine draws per run.
"""
from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# numpy's OpenBLAS threads (unused here) spin on the cores the engine's OpenMP threads need;
# must be set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click
import numpy as np

from engine import registry
from engine.model import Model

SHAPE_8B = "8b-shape"
SHAPE_1_5B = "1.5b-shape"
# (prefill, decode) per model
DEFAULT_LENGTHS = {SHAPE_8B: (256, 16), SHAPE_1_5B: (256, 32), "qwen3-4b-shape": (256, 16), "llama3.2-3b-shape": (256, 16),
                   "moe-shape": (256, 16)}
OTHER_LENGTHS = (256, 64)
PEER_TIMEOUT_S = 1800


def model_file(name: str) -> Path:
    from bench.shapes import SHAPES, ensure  # bench/shapes.py

    if name in SHAPES:
        return ensure(name, log=lambda m: print(m, file=sys.stderr))
    return registry.resolve(name)


def prompt_tokens(n: int, vocab: int, bos: int | None, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    toks = [int(t) for t in rng.integers(100, min(vocab, 30000), size=n)]
    if bos is not None:
        toks[0] = bos
    return toks


def bench_ours(model: Model, toks: list[int], n_decode: int) -> tuple[float, float]:
    """Prefill tok/s of toks, then decode tok/s of n_decode tokens from an empty context (positions 0..),
    as llama-bench's tests run: its generation test clears the cache and decodes from position 0, so
    decoding after the prompt instead would time ours over 256 more positions of attention."""
    t0 = time.perf_counter()
    model.forward(toks, 0)
    t1 = time.perf_counter()
    tok = toks[0]
    for i in range(n_decode):
        logits = model.forward([tok], i)
        tok = int(np.argmax(logits))
    t2 = time.perf_counter()
    return len(toks) / (t1 - t0), n_decode / (t2 - t1)


def drop_cached_pages(path: Path) -> None:
    """Ask the kernel to drop the file's pages from the page cache (POSIX_FADV_DONTNEED; pages some
    process has mapped stay), so that the next reader reads it into newly placed memory."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_afresh(path: Path) -> None:
    """Drop the file's pages from the page cache, then read it through, so that it sits in newly
    placed memory and no read-ahead of it is left running (on 2 cores that took up to half of the next
    timed prefill's CPU: Gemma 3 at 1,822 instead of 3,700 tok/s in one run of five)."""
    drop_cached_pages(path)
    buf = memoryview(bytearray(8 << 20))
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def weight_files(model: Model, path: Path) -> list[Path]:
    """The files our engine reads the model's weights from: the GGUF and its repacked cache, if any."""
    repacked = getattr(getattr(model, "layout", None), "repacked", None)
    return [path] + ([Path(repacked)] if repacked is not None else [])


class LlamaCpp:
    """llama.cpp through llama-cpp-python, in this process."""

    def __init__(self, path: Path, threads: int, n_ctx: int):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, n_ubatch=512, no_perf=False, verbose=False)

    def bench(self, toks: list[int], n_decode: int) -> tuple[float, float]:
        return peer_run(self.llm, toks, n_decode)


def _clear(llm) -> None:
    """Empty a llama_cpp.Llama's context: positions restart at 0, so the old sequence must go."""
    llm.reset()
    llm._ctx.kv_cache_clear()


def peer_run(llm, toks: list[int], n_decode: int) -> tuple[float, float]:
    """Prefill and decode tok/s of a llama_cpp.Llama, each from a cleared cache (as bench_ours)."""
    _clear(llm)
    # Wall clock around eval: llama.cpp's perf counters read zero through this binding; the
    # binding's own overhead is tens of microseconds per call against milliseconds of compute.
    t0 = time.perf_counter()
    llm.eval(toks)
    t1 = time.perf_counter()
    _clear(llm)
    tok = toks[0]
    t_decode = 0.0
    for _ in range(n_decode):
        ta = time.perf_counter()
        llm.eval([tok])
        t_decode += time.perf_counter() - ta
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return len(toks) / (t1 - t0), n_decode / t_decode


class PeerError(RuntimeError):
    pass


def llama_bench_command(exe: str | os.PathLike[str], path: Path, threads: int, n_prefill: int, n_decode: int,
                        extra: tuple[str, ...] = ()) -> list[str]:
    return [str(exe), "-m", str(path), "-p", str(n_prefill), "-n", str(n_decode), "-t", str(threads),
            "-r", "1", "-o", "json", "-ngl", "0", *extra]


def parse_llama_bench_json(text: str) -> tuple[float, float]:
    """(prompt tok/s, generation tok/s) from llama-bench's `-o json` output."""
    start = text.find("[")  # anything printed before the JSON array is ignored
    if start < 0:
        raise PeerError("no JSON array in llama-bench's output")
    try:
        tests = json.loads(text[start:])
    except json.JSONDecodeError as e:
        raise PeerError(f"llama-bench's JSON does not parse: {e}") from None
    pp = [t["avg_ts"] for t in tests if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0]
    tg = [t["avg_ts"] for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if len(pp) != 1 or len(tg) != 1:
        raise PeerError(f"expected one prompt and one generation test, got {len(pp)} and {len(tg)}")
    return float(pp[0]), float(tg[0])


@dataclass
class LlamaBench:
    """A llama-bench binary (llama.cpp's or ik_llama.cpp's), one subprocess per repetition."""
    label: str
    exe: str
    extra: tuple[str, ...] = ()
    error: str | None = field(default=None)

    def bench(self, path: Path, threads: int, n_prefill: int, n_decode: int) -> tuple[float, float]:
        cmd = llama_bench_command(self.exe, path, threads, n_prefill, n_decode, self.extra)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PEER_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerError(f"{self.label}: {' '.join(cmd)}: {e}") from None
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise PeerError(f"{self.label}: {' '.join(cmd)} exited {proc.returncode}:\n{tail}")
        try:
            return parse_llama_bench_json(proc.stdout)
        except PeerError as e:
            raise PeerError(f"{self.label}: {e}") from None


def spread(runs: list[tuple[float, float]], i: int) -> float:
    values = [r[i] for r in runs]
    return max(values) / min(values) - 1


def median_pair(runs: list[tuple[float, float]]) -> tuple[float, float]:
    if not runs:
        return math.nan, math.nan
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def kernel_path() -> str:
    """The kernel path our engine runs on (engine.kernels._kernels.kernel_path()), "avx2/vnni" when the
    avx2 path runs its AVX-VNNI prefill kernels."""
    from engine.kernels import _kernels

    path = str(_kernels.kernel_path())
    return path + "/vnni" if path == "avx2" and _kernels.avxvnni() else path


def paired_ratio(ours: list[tuple[float, float]], theirs: list[tuple[float, float]], i: int) -> float:
    """The median over reps of ours / the peer's run of the same rep, figure i. The runs of a rep follow
    each other within a minute, so a pair shares the host's state (on shared machines memory bandwidth
    changes within seconds) more often than the two medians do."""
    xs = [a[i] / b[i] for a, b in zip(ours, theirs)
          if b[i] and not math.isnan(a[i]) and not math.isnan(b[i])]
    return statistics.median(xs) if xs else math.nan


def best_of(settings: dict[str, tuple[float, float]], i: int) -> tuple[float, str]:
    """The best median of figure i among a peer's settings, and that setting's name."""
    ok = {k: v[i] for k, v in settings.items() if not math.isnan(v[i])}
    if not ok:
        return math.nan, "-"
    name = max(ok, key=ok.get)
    return ok[name], name


def fmt(x: float, width: int, spec: str = ".1f") -> str:
    return f"{'-':>{width}}" if math.isnan(x) else f"{x:>{width}{spec}}"


def ratio(ours: float, theirs: float, width: int) -> str:
    x = ours / theirs if theirs and not math.isnan(theirs) else math.nan
    return f"{'-':>{width}}" if math.isnan(x) else f"{x:>{width - 1}.2f}x"


def print_table(rows: list[dict], reps: int, peers: list[str]) -> None:
    print(f"\nprefill (pp) / decode (tg) tok/s; medians of {reps} interleaved runs")
    header = f"{'model':<14} {'thr':>3} {'lengths':>11} {'kernel':>10} {'ours pp':>8} {'ours tg':>8}"
    for p in peers:
        header += f" {p + ' pp':>{max(8, len(p) + 3)}} {p + ' tg':>{max(8, len(p) + 3)}}"
        if p == "ik":
            header += f" {'ik set':>11}"
    for p in peers:
        header += f" {'/' + p + ' pp':>{max(7, len(p) + 4)}} {'/' + p + ' tg':>{max(7, len(p) + 4)}}"
    print(header)
    for r in rows:
        line = (f"{r['model']:<14} {r['threads']:>3} {r['lengths']:>11} {r['kernel']:>10}"
                f" {fmt(r['ours'][0], 8)} {fmt(r['ours'][1], 8)}")
        for p in peers:
            w = max(8, len(p) + 3)
            line += f" {fmt(r[p][0], w)} {fmt(r[p][1], w)}"
            if p == "ik":
                line += f" {r['ik_setting'][0] + '/' + r['ik_setting'][1]:>11}"
        for p in peers:
            w = max(7, len(p) + 4)
            line += f" {ratio(r['ours'][0], r[p][0], w)} {ratio(r['ours'][1], r[p][1], w)}"
        print(line)
    if "ik" in peers:
        print("ik set: the ik_llama.cpp setting each ik figure comes from, pp/tg (plain, or rtr = -rtr 1); "
              "both settings' medians:")
        for r in rows:
            print(f"  {r['model']:<14} {r['threads']:>3}  " +
                  "  ".join(f"{k} {fmt(v[0], 0)}/{fmt(v[1], 0)}" for k, v in r["ik_settings"].items()))
    print("/peer: ours divided by the peer (above 1: ours is faster)")
    print("paired: the median over reps of ours / that rep's peer run (ik: the setting above), pp and tg:")
    for r in rows:
        parts = " ".join(f"/{name} {ratio(x[0], 1.0, 6)} {ratio(x[1], 1.0, 6)}" for name, x in r["paired"].items())
        print(f"  {r['model']:<14} {r['threads']:>3}  {parts}")
    print("spread of the runs (max/min - 1), pp and tg:")
    for r in rows:
        parts = " ".join(f"{name} {s[0]:>4.0%} {s[1]:>4.0%}" for name, s in r["spread"].items())
        print(f"  {r['model']:<14} {r['threads']:>3}  {parts}")


@click.command()
@click.option("--model", "model_names", multiple=True, default=("smollm2-135m", "gemma3-270m"),
              help="A known model, a bench/shapes.py name (8b-shape, 1.5b-shape, qwen3-4b-shape, "
                   "llama3.2-3b-shape, moe-shape) or a .gguf path; repeatable.")
@click.option("--threads", "thread_counts", multiple=True, type=int, default=(1, 2))
@click.option("--reps", type=int, default=5)
@click.option("--prefill", "prefill_arg", type=int, default=None, help="Prompt tokens (default per model).")
@click.option("--decode", "decode_arg", type=int, default=None, help="Decoded tokens (default per model).")
@click.option("--llama-bench", "llama_bench", type=click.Path(exists=True, dir_okay=False), default=None,
              help="llama.cpp's llama-bench binary (a peer).")
@click.option("--ik-bench", "ik_bench", type=click.Path(exists=True, dir_okay=False), default=None,
              help="ik_llama.cpp's llama-bench binary (a peer, run without and with -rtr 1).")
@click.option("--peer-python", is_flag=True,
              help="Also run llama-cpp-python (default: only when neither binary is given and it is installed).")
@click.option("--no-peer", is_flag=True, help="Ours only.")
@click.option("--kernel", default=None, help="Kernel path for our runs (sets RQLLM_KERNEL), e.g. scalar, avx2, avx512.")
@click.option("--fresh-pages/--keep-pages", default=True, show_default=True,
              help="Drop each engine's weight files from the page cache before each of its runs, so every "
                   "run reads them into newly placed memory (see the module docstring).")
def main(model_names, thread_counts, reps, prefill_arg, decode_arg, llama_bench, ik_bench, peer_python, no_peer, kernel,
         fresh_pages):
    if kernel:
        os.environ["RQLLM_KERNEL"] = kernel  # read when the kernels first initialise, below
    active = kernel_path()
    forced = os.environ.get("RQLLM_KERNEL")
    if forced and active.split("/")[0] != forced:
        raise click.UsageError(f"RQLLM_KERNEL={forced} asked for, but our kernels run {active} "
                               "(an unknown name, a path this CPU lacks, or kernels initialised earlier)")
    print(f"our kernel path: {active}" + (f" (RQLLM_KERNEL={forced})" if forced else ""), file=sys.stderr)

    binaries: list[LlamaBench] = []
    if not no_peer:
        if llama_bench:
            binaries.append(LlamaBench("llama", llama_bench))
        if ik_bench:
            binaries += [LlamaBench("ik", ik_bench), LlamaBench("ik-rtr", ik_bench, ("-rtr", "1"))]
    use_python = False
    if not no_peer and (peer_python or not binaries):
        try:
            import llama_cpp  # noqa: F401
            use_python = True
        except ImportError:
            msg = "llama-cpp-python not installed"
            if peer_python:
                raise click.UsageError(f"--peer-python: {msg}") from None
            print(f"{msg}: no in-process peer", file=sys.stderr)
    peers = (["llama"] if llama_bench and not no_peer else []) + (["ik"] if ik_bench and not no_peer else [])
    if use_python:
        peers.append("llama-py")

    rows = []
    for name in model_names:
        path = model_file(name)
        n_prefill, n_decode = DEFAULT_LENGTHS.get(name, OTHER_LENGTHS)
        n_prefill, n_decode = prefill_arg or n_prefill, decode_arg or n_decode
        for threads in thread_counts:
            def load_ours() -> Model:
                return Model.load(path, threads=threads, kv_budget="256MiB", max_context=n_prefill + n_decode + 8)

            ours = load_ours()   # (builds the repacked cache if it is missing: its path is known after)
            repacked = getattr(getattr(ours, "layout", None), "repacked", None) is not None
            print(f"{name}: weights {'repacked (R16)' if repacked else 'GGUF layout'}", file=sys.stderr)
            cfg = ours.cfg
            bos = ours.gguf.get("tokenizer.ggml.bos_token_id")
            toks = prompt_tokens(n_prefill, cfg.n_vocab, bos)
            py_peer = LlamaCpp(path, threads, n_prefill + n_decode + 8) if use_python else None
            # Warm-up at full prompt length (as llama-bench's own warm-up run): pages in the weights
            # and touches every prefill pass and the KV cache, so the first timed run is not an outlier.
            bench_ours(ours, toks, 4)
            if py_peer:
                py_peer.bench(toks, 4)
            runs: dict[str, list[tuple[float, float]]] = {"ours": []}
            runs.update({b.label: [] for b in binaries})
            if py_peer:
                runs["llama-py"] = []
            for rep in range(reps):
                if fresh_pages:   # every rep, the first too: its repacked cache may have been evicted by
                    # the peers' runs of an earlier model, and a mixture of experts' warm-up touches only
                    # the experts it routes to (one moe-shape rep decoded at 25 tok/s, the next two 57 and 45)
                    files = weight_files(ours, path)
                    del ours
                    gc.collect()   # unmaps the files, so that their pages can be dropped
                    for f in files:
                        read_afresh(f)
                    ours = load_ours()
                    bench_ours(ours, toks, 4)   # the warm-up, as above
                runs["ours"].append(bench_ours(ours, toks, n_decode))
                for b in binaries:
                    if b.error:
                        continue
                    if fresh_pages:
                        read_afresh(path)
                    try:
                        runs[b.label].append(b.bench(path, threads, n_prefill, n_decode))
                    except PeerError as e:
                        b.error = str(e)
                        print(f"peer failed (skipped from now on for {name}): {e}", file=sys.stderr)
                if py_peer:
                    runs["llama-py"].append(py_peer.bench(toks, n_decode))
                print(f"{name} t{threads} rep {rep + 1}/{reps}: " +
                      ", ".join(f"{k} {v[-1][0]:.1f}/{v[-1][1]:.1f}" for k, v in runs.items() if len(v) == rep + 1),
                      file=sys.stderr)
            for b in binaries:
                b.error = None  # a failure on one model does not skip the peer on the next
            medians = {k: median_pair(v) for k, v in runs.items()}
            row = {"model": name, "threads": threads, "lengths": f"pp{n_prefill}/tg{n_decode}",
                   "kernel": active + ("+r16" if repacked else ""),
                   "ours": medians["ours"], "spread": {}, "paired": {}}
            if "llama" in medians:
                row["llama"] = medians["llama"]
            if "llama-py" in medians:
                row["llama-py"] = medians["llama-py"]
            for label in ("llama", "llama-py"):
                if label in medians:
                    row["paired"][label] = (paired_ratio(runs["ours"], runs[label], 0),
                                            paired_ratio(runs["ours"], runs[label], 1))
            if "ik" in medians:
                ik = {"plain": medians["ik"], "rtr": medians["ik-rtr"]}
                (pp, pp_set), (tg, tg_set) = best_of(ik, 0), best_of(ik, 1)
                row["ik"] = (pp, tg)
                row["ik_setting"] = (pp_set, tg_set)
                row["ik_settings"] = ik
                ik_runs = {"plain": runs["ik"], "rtr": runs["ik-rtr"]}
                row["paired"]["ik"] = tuple(paired_ratio(runs["ours"], ik_runs.get(st, []), i)
                                            for i, st in ((0, pp_set), (1, tg_set)))
            for k, v in runs.items():
                if v:
                    row["spread"][k] = (spread(v, 0), spread(v, 1))
            rows.append(row)
            del ours, py_peer
    print_table(rows, reps, peers)
    print("weights: " + ("dropped from the page cache and read afresh before every run (--fresh-pages)" if fresh_pages
                         else "kept in the page cache between runs (--keep-pages)"))
    print(f"peak RSS of this process (ours{' and llama-cpp-python' if use_python else ''}): {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    main()

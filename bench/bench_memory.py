"""Peak RSS of our engine, and of llama.cpp for comparison, each alone in a fresh process.

    python -m bench.bench_memory [--model 8b-shape] [--kv-tokens 4096] [--prefill 64] [--decode 16] [--threads 2]

Each engine runs in its own subprocess (so nothing else is counted): load the model with a KV
cache of --kv-tokens tokens (ours: a byte budget worth exactly that many f32 K+V rows and
max_context = kv-tokens; llama.cpp: n_ctx = kv-tokens, its default f16 cache), prefill
--prefill tokens, decode --decode tokens, then report ru_maxrss (the peak RSS: mapped weight
pages that were touched count in it), the file-backed and anonymous parts of the RSS at the end,
the KV bytes and the mapped weights size.  Our KV arrays are zero pages until written, so a short
run leaves most of them out of the RSS; "peak, KV full" is the peak after every KV page has been
written too (a worker that has served a full-length prompt).  llama.cpp clears its cache at load.
The issue's target for 8b-shape with a 4,096-token KV budget: our peak RSS <= 6 GB.
`--pss` measures something else: PSS of two real worker processes (bench/pss_workers.py), on the
repacked weight cache as workers run by default (`--no-repack`: on the GGUF layout).
`--repack-report` writes the repacked weight cache (engine.repack) of --model (8b-shape) again, in a
fresh process on --threads threads, and reports its time, its size on disk and the builder's peak
RSS (the target: < 60 s for a 4.6 GB file on 2 cores, so a first start is not a long wait); `--cold` first evicts the GGUF from the page
cache (posix_fadvise DONTNEED), so the time includes reading it from disk.
Our engine runs as it does by default: on the repacked cache when the kernel path reads R16 (the
result line says which; `--no-repack` for the GGUF layout).
Speeds are not measured here (bench_engine.py does that).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as bench_engine: keep numpy's pool off the cores

import click

from bench.bench_engine import bench_ours, model_file, peer_run, prompt_tokens

BENCH = Path(__file__).resolve().parent

GB = 1e9
GIB = 1024**3


def _proc_status() -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile in bytes (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def kv_budget_bytes(path: Path, tokens: int) -> int:
    """Bytes of our f32 KV cache for `tokens` tokens of this model (K and V, every layer)."""
    from engine.gguf_file import GGUFFile
    from engine.kv_cache import KVCache
    from engine.model import Config, kv_layout

    with GGUFFile(path) as f:
        cfg = Config.from_gguf(f)
    _, _, kv_dim, local, _ = kv_layout(cfg, 1, tokens)
    _, nbytes = KVCache.plan(1 << 62, kv_dim, local, tokens)
    return nbytes


def run_ours(path: Path, threads: int, kv_tokens: int, n_prefill: int, n_decode: int, repack: bool = True) -> dict:
    from engine.engine import Engine

    eng = Engine(path, threads=threads, kv_budget=kv_budget_bytes(path, kv_tokens), max_context=kv_tokens,
                 repack=None if repack else False)
    model = eng.model
    after_load = _proc_status()
    bos = model.gguf.get("tokenizer.ggml.bos_token_id")
    bench_ours(model, prompt_tokens(n_prefill, model.cfg.n_vocab, bos), n_decode)
    end = _proc_status()
    peak = _peak_rss()
    for a in (*model.kv.k, *model.kv.v):
        a.fill(0.0)  # writing faults in every page of the cache
    weights = sum(info.nbytes for info in model.gguf.tensors.values())
    return {"engine": "ours", "layout": model.layout.reason,
            "kv_tokens": model.capacity, "kv_bytes": model.kv.nbytes, "weights_bytes": weights,
            "rss_after_load": after_load["VmRSS"], "rss_file_end": end["RssFile"], "rss_anon_end": end["RssAnon"],
            "peak_rss": peak, "peak_rss_kv_full": _peak_rss()}


def run_llama(path: Path, threads: int, kv_tokens: int, n_prefill: int, n_decode: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=kv_tokens, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, n_ubatch=512, verbose=False)
    after_load = _proc_status()
    peer_run(llm, prompt_tokens(n_prefill, llm.n_vocab(), llm.token_bos()), n_decode)
    end = _proc_status()
    # llama.cpp's cache is f16 by default: 2 bytes per K and per V element.
    meta = llm.metadata
    arch = meta["general.architecture"]
    n_layer = int(meta[f"{arch}.block_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length") or
                   int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"]))
    kv_dim = int(meta[f"{arch}.attention.head_count_kv"]) * head_dim
    return {"engine": "llama.cpp", "kv_tokens": llm.n_ctx(), "kv_bytes": llm.n_ctx() * n_layer * kv_dim * 2 * 2,
            "weights_bytes": path.stat().st_size, "rss_after_load": after_load["VmRSS"],
            "rss_file_end": end["RssFile"], "rss_anon_end": end["RssAnon"], "peak_rss": _peak_rss(),
            "peak_rss_kv_full": _peak_rss()}


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(engine: str, path: Path, threads: int, kv_tokens: int, n_prefill: int, n_decode: int,
          repack: bool = True) -> None:
    if engine == "ours":
        result = run_ours(path, threads, kv_tokens, n_prefill, n_decode, repack)
    else:
        result = run_llama(path, threads, kv_tokens, n_prefill, n_decode)
    print("RESULT " + json.dumps(result), flush=True)


def measure(engine: str, path: Path, threads: int, kv_tokens: int, n_prefill: int, n_decode: int,
            repack: bool = True) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_memory", "--child", engine, "--path", str(path),
           "--threads", str(threads), "--kv-tokens", str(kv_tokens), "--prefill", str(n_prefill),
           "--decode", str(n_decode)]
    if not repack:
        cmd.append("--no-repack")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=BENCH.parent)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{engine} run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")


def repack_child_run(path: Path, threads: int, cold: bool) -> None:
    """Rebuild the repacked cache of path (force) and print what it took (a fresh process: its peak
    RSS is the build's)."""
    import shutil
    import time

    from tqdm import tqdm

    from engine import repack
    from engine.gguf_file import GGUFFile
    from engine.model import Config, Weights

    if cold:  # the first build on a host reads the GGUF from disk
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    root = repack.cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with GGUFFile(path, index_cache=True) as g:
        names = Weights(g, Config.from_gguf(g)).matmul_names()
        with tqdm(total=None, unit="B", unit_scale=True, desc="repacking", file=sys.stderr) as bar:
            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            t0 = time.perf_counter()
            cache = repack.load_or_build(g, names, threads=threads, progress=progress, force=True)
            seconds = time.perf_counter() - t0
        if cache is None:
            raise SystemExit(f"{path}: nothing to repack (no weight matrix of a type R16 covers)")
        result = {"path": str(cache.path), "bytes": cache.nbytes, "gguf_bytes": g.size,
                  "repacked_source_bytes": sum(t.source_nbytes for t in cache.plan.tensors),
                  "tensors": len(cache.plan.tensors), "seconds": seconds, "build_seconds": cache.build_seconds,
                  "threads": threads, "cold": cold, "free_after": shutil.disk_usage(root).free,
                  "peak_rss": _peak_rss()}
        cache.close()
    print("RESULT " + json.dumps(result), flush=True)


def run_repack_report(model: str, threads: int, cold: bool) -> None:
    path = model_file(model)
    cmd = [sys.executable, "-m", "bench.bench_memory", "--repack-child", "--path", str(path), "--threads", str(threads)]
    proc = subprocess.run(cmd + (["--cold"] if cold else []), stdout=subprocess.PIPE, text=True,  # progress: stderr
                          cwd=BENCH.parent)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the repack failed (exit {proc.returncode})")
    r = json.loads(lines[-1][len("RESULT "):])
    verdict = "met" if r["seconds"] < 60 else "NOT met"
    source = "read from disk" if r["cold"] else "in the page cache"
    print(f"{model}: repacked {r['tensors']} weight matrices ({r['repacked_source_bytes'] / GB:.2f} GB of the "
          f"{r['gguf_bytes'] / GB:.2f} GB GGUF) in {r['seconds']:.1f} s on {r['threads']} threads "
          f"({r['repacked_source_bytes'] / 1e6 / r['seconds']:.0f} MB/s; GGUF {source}); target < 60 s: {verdict}")
    print(f"{'':>{len(model) + 2}}disk use {r['bytes'] / GB:.2f} GB ({r['path']}; "
          f"{r['free_after'] / GB:.1f} GB left free); the builder's peak RSS {r['peak_rss'] / 1e6:.0f} MB")


@click.command()
@click.option("--model", default="8b-shape", help="A known model name, 8b-shape, or a .gguf path.")
@click.option("--threads", type=int, default=2)
@click.option("--kv-tokens", type=int, default=4096)
@click.option("--prefill", "n_prefill", type=int, default=64)
@click.option("--decode", "n_decode", type=int, default=16)
@click.option("--no-peer", is_flag=True, help="Skip llama.cpp.")
@click.option("--child", "child_engine", type=click.Choice(["ours", "llama"]), default=None, hidden=True)
@click.option("--path", "child_path", type=click.Path(path_type=Path), default=None, hidden=True)
@click.option("--pss", is_flag=True, help="Instead: what a second real worker adds to the host's PSS "
              "(bench/pss_workers.py; --pss-model, --kv-budget, --threads).")
@click.option("--pss-model", default="smollm2-135m", show_default=True, help="Model for --pss.")
@click.option("--kv-budget", default="256MiB", show_default=True, help="Each worker's KV budget for --pss.")
@click.option("--max-tokens", default=32, show_default=True, help="Length of each --pss job.")
@click.option("--no-repack", is_flag=True, help="Our engine / the --pss workers on the GGUF layout, without the "
              "repacked weight cache.")
@click.option("--repack-report", is_flag=True, help="Instead: rebuild --model's repacked weight cache and report "
              "its time, disk use and the builder's peak RSS.")
@click.option("--cold", is_flag=True, help="With --repack-report: evict the GGUF from the page cache first.")
@click.option("--repack-child", is_flag=True, hidden=True)
def main(model, threads, kv_tokens, n_prefill, n_decode, no_peer, child_engine, child_path, pss, pss_model,
         kv_budget, max_tokens, no_repack, repack_report, cold, repack_child):
    if repack_child:
        repack_child_run(child_path, threads, cold)
        return
    if repack_report:
        run_repack_report(model, threads, cold)
        return
    if pss:
        from bench.pss_workers import measure_pss

        measure_pss(str(model_file(pss_model)), kv_budget, threads, max_tokens, repack=not no_repack)
        return
    if child_engine:
        child(child_engine, child_path, threads, kv_tokens, n_prefill, n_decode, repack=not no_repack)
        return
    path = model_file(model)
    engines = ["ours"] if no_peer else ["ours", "llama"]
    print(f"{model}: {path} ({path.stat().st_size / GIB:.2f} GiB), {threads} threads, KV {kv_tokens} tokens, "
          f"pp{n_prefill} + tg{n_decode}, each engine alone in a fresh process")
    print(f"{'engine':<10} {'peak RSS':>9} {'peak, KV full':>14} {'after load':>11} {'file/anon at end':>17}"
          f" {'KV':>9} {'weights':>9}   (GB = 1e9 bytes, GiB = 2^30)")
    for engine in engines:
        r = measure(engine, path, threads, kv_tokens, n_prefill, n_decode, repack=not no_repack)
        print(f"{r['engine']:<10} {r['peak_rss'] / GB:>6.2f} GB {r['peak_rss_kv_full'] / GB:>11.2f} GB"
              f" {r['rss_after_load'] / GB:>8.2f} GB {r['rss_file_end'] / GB:>7.2f} / {r['rss_anon_end'] / GB:.2f} GB"
              f" {r['kv_bytes'] / GIB:>5.2f} GiB {r['weights_bytes'] / GIB:>5.2f} GiB")
        if engine == "ours":
            print(f"{'':<10} weights: {r['layout']}")
            verdict = "meets" if r["peak_rss_kv_full"] <= 6 * GB else "misses"
            print(f"{'':<10} KV holds {r['kv_tokens']} tokens; target peak RSS (KV full) <= 6 GB: {verdict}")


if __name__ == "__main__":
    main()

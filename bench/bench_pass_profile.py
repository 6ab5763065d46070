"""Where a prefill pass spends its CPU time, ours against a peer's llama-bench, by what each function does (perf).

    python -m bench.bench_pass_profile --model moe-shape --threads 2 --passes 12 \\
        --peer /path/to/ik_llama.cpp/build/bin/llama-bench --peer-arg=-rtr --peer-arg=1

Both engines run under `perf record -e cpu-clock` (Linux perf; no hardware counters needed). Ours loads the model and
runs one untimed pass, then perf attaches to this process for `--passes` prefill passes of the prompt. The peer's
llama-bench runs whole (`-p N -n 0 -r PASSES`, its warm-up turned off); its loading and run-time repacking
(kernel-mode samples, `repack_*`) are counted apart and left out of the per-pass figures (so are both engines'
kernel-mode samples during the passes: page faults, a small share). Samples are summed by
category (each weight type's matrices, our group expansion, the activations' quantization, attention, the threads'
synchronisation, the rest) and printed as CPU seconds per pass, for both engines side by side.

The categories come from the functions' names (`symbol_category`): ours are r16g256_q4_K and the like, llama.cpp's
and ik_llama.cpp's mul_mat_q4_k_r4_q8_k, ggml_vec_dot_q4_K_q8_K and the like.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as bench_engine: numpy's threads would spin on our cores

import click

SAMPLE_HZ = 1000
LOAD = "kernel mode, repacking (left out)"
# Checked in this order; a weight type's matmuls come after these (ik's flash attention is `..._fa4<...>`, its
# activation quantizer `iqk_quantize_row_q8_K`: neither is a Q8_K matmul).
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    (LOAD, re.compile(r"^\[k\]|repack_")),
    ("activation quantization", re.compile(r"quantize")),
    ("group expansion (ours)", re.compile(r"r16_expand")),
    ("attention", re.compile(r"attend_|flash|_fa\d|softmax|attention\._omp")),
    ("thread sync", re.compile(r"ggml_barrier|gomp_|GOMP_")),
]
WEIGHT_TYPE = re.compile(r"(?i)(?:^|[^a-z0-9])(iq4_nl|iq4_xs|q[2-8]_k|q[4-8]_[01])(?=[^a-z0-9]|$)")
REPORT_LINE = re.compile(r"^\s*[\d.]+%\s+(\d+)\s+(\[[.k]\])\s+(.*?)\s*$")


def symbol_category(symbol: str) -> str:
    """What a function does, from its name as perf reports it (with its `[.]` / `[k]` mark)."""
    for name, rx in CATEGORIES:
        if rx.search(symbol):
            return name
    m = WEIGHT_TYPE.search(symbol.split("] ", 1)[-1])
    return f"{m.group(1).upper()} matrices" if m else "the rest"


def parse_report(text: str) -> dict[str, int]:
    """Samples per category from `perf report --sort symbol -g none -n -F overhead,sample,symbol`."""
    samples: dict[str, int] = defaultdict(int)
    for line in text.splitlines():
        m = REPORT_LINE.match(line)
        if m:
            samples[symbol_category(f"{m.group(2)} {m.group(3)}")] += int(m.group(1))
    return dict(samples)


def perf_record(data: Path) -> list[str]:
    """The recording command both engines run under (followed by `-p PID` or `-- COMMAND`)."""
    return ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(SAMPLE_HZ), "-o", str(data)]


def perf_report(data: Path) -> dict[str, int]:
    out = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "symbol", "-g", "none", "-n",
                          "-F", "overhead,sample,symbol"], capture_output=True, text=True, check=True).stdout
    return parse_report(out)


def profile_ours(path: Path, ntok: int, threads: int, passes: int, data: Path) -> float:
    """Samples of `passes` prefill passes in this process into `data`; returns their tok/s."""
    from bench.bench_engine import prompt_tokens
    from engine.model import Model

    model = Model.load(path, threads=threads, kv_budget="512MiB", max_context=ntok + 16)
    toks = prompt_tokens(ntok, model.cfg.n_vocab, model.gguf.get("tokenizer.ggml.bos_token_id"))
    model.forward(toks, 0)   # untimed: first touches of the pages and buffers
    perf = subprocess.Popen([*perf_record(data), "-p", str(os.getpid())], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(1.0)   # perf attaches asynchronously
    t0 = time.perf_counter()
    for _ in range(passes):
        model.forward(toks, 0)
    elapsed = time.perf_counter() - t0
    perf.send_signal(signal.SIGINT)
    perf.wait(timeout=60)
    return passes * ntok / elapsed


def no_warmup_args(usage: str) -> tuple[str, ...]:
    """llama-bench's flag that turns its warm-up off, from its usage text: llama.cpp's warm-up is a whole prompt pass,
    ik_llama.cpp's one token, so neither can simply be counted as a pass."""
    if "--no-warmup" in usage:
        return ("--no-warmup",)
    if re.search(r"-w, --warmup <0\|1>", usage):
        return ("-w", "0")
    raise click.UsageError("this llama-bench has no flag to turn its warm-up off (--no-warmup or -w 0)")


def profile_peer(exe: str, path: Path, ntok: int, threads: int, passes: int, extra: tuple[str, ...],
                 data: Path) -> None:
    help_run = subprocess.run([exe, "--help"], capture_output=True, text=True)
    quiet = no_warmup_args(help_run.stdout + help_run.stderr)
    subprocess.run([*perf_record(data), "--", exe, "-m", str(path), "-p", str(ntok), "-n", "0", "-t", str(threads),
                    "-r", str(passes), "-ngl", "0", *quiet, *extra],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def per_pass(samples: dict[str, int], passes: int) -> dict[str, float]:
    return {k: v / SAMPLE_HZ / passes for k, v in samples.items() if k != LOAD}


@click.command()
@click.option("--model", "model_name", default="moe-shape", show_default=True,
              help="A shape of bench/shapes.py, a registry name or a GGUF path.")
@click.option("--prefill", default=256, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--passes", default=12, show_default=True)
@click.option("--peer", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A llama-bench binary (llama.cpp or ik_llama.cpp) profiled the same way.")
@click.option("--peer-arg", "peer_args", multiple=True, help="An extra llama-bench argument (repeat: --peer-arg=-rtr --peer-arg=1).")
def main(model_name: str, prefill: int, threads: int, passes: int, peer: str | None, peer_args: tuple[str, ...]) -> None:
    from bench.bench_engine import model_file

    if shutil.which("perf") is None:
        raise click.UsageError("needs Linux perf (Debian: apt install linux-perf)")
    path = Path(model_name) if model_name.endswith(".gguf") else model_file(model_name)
    with tempfile.TemporaryDirectory() as tmp:
        ours_data, peer_data = Path(tmp) / "ours.data", Path(tmp) / "peer.data"
        rate = profile_ours(path, prefill, threads, passes, ours_data)
        columns = {"ours": per_pass(perf_report(ours_data), passes)}
        if peer:
            profile_peer(peer, path, prefill, threads, passes, peer_args, peer_data)
            peer_samples = perf_report(peer_data)
            columns["peer"] = per_pass(peer_samples, passes)
    click.echo(f"{path.name}, pp{prefill}, {threads} threads, {passes} passes; ours {rate:.1f} tok/s under perf")
    click.echo("CPU seconds per pass, by what the functions do:")
    names = sorted({k for c in columns.values() for k in c}, key=lambda k: -max(c.get(k, 0.0) for c in columns.values()))
    click.echo(f"{'':28s}" + "".join(f"{c:>10s}" for c in columns))
    for name in names:
        click.echo(f"{name:28s}" + "".join(f"{c.get(name, 0.0):10.3f}" for c in columns.values()))
    click.echo(f"{'total':28s}" + "".join(f"{sum(c.values()):10.3f}" for c in columns.values()))
    if peer:
        click.echo(f"peer's kernel mode and repacking, left out: {peer_samples.get(LOAD, 0) / SAMPLE_HZ:.2f} CPU-s in all")


if __name__ == "__main__":
    sys.exit(main())

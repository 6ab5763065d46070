"""Coverage table: every weight type and architecture, greedy agreement with llama.cpp and decode speed.

    python -m bench.bench_coverage [--name Q4_K --name qwen2 ...] [--reps 3] [--threads 2] [--decode 64]

For each test model of tests/quant_models.py (SmolLM2 requantized to each of the 13 weight types,
the random-weight qwen2 model, SmolLM2 with an untied output.weight) it prints one Markdown row:

* greedy agreement: our free-running greedy 32 tokens against llama.cpp's, on the same 8 prompts
  and the same file (llama.cpp's prompt ids; both stop at EOS).  "runs" = whole runs identical
  (out of 8), "tokens" = tokens before the first difference, summed (out of llama.cpp's total,
  <= 256).  After a near-tie the two runs part ways for good, so "tokens" undercounts agreement;
  tests/test_quant_coverage.py checks each step teacher-forced;
* decode tok/s, ours and llama.cpp's (llama-cpp-python, timed around its eval calls as in
  bench/bench_engine.py), 2 threads, median of --reps runs of --decode tokens after a 32-token
  prompt, the two engines interleaved (the machine is shared and noisy), and their ratio.
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

import click
import numpy as np

from bench.bench_engine import bench_ours, peer_run
from engine import registry
from engine.model import Model
from tests import quant_models as QM
from tests.tools import make_llamacpp_fixtures as fixtures

ROOT = Path(__file__).resolve().parents[1]

N_GREEDY = 32


def describe(name: str) -> str:
    if name == "qwen2":
        return "random qwen2 (4 layers, hidden 256, GQA 4/2, q/k/v biases, untied; Q2_K..Q6_K, Q8_0, F16)"
    if name == "llama-untied":
        return "SmolLM2-135M Q8_0 + untied output.weight (mistral-style llama)"
    if name in QM.K_TYPES:
        return f"SmolLM2-135M: ffn_down {name}, other matrices Q8_0 (rows of 576)"
    return f"SmolLM2-135M, all matrices {name}"


def our_greedy(model: Model, prompt: list[int], eos: int) -> list[int]:
    logits = model.forward(prompt, 0)
    out: list[int] = []
    while True:
        tok = int(np.argmax(logits))
        out.append(tok)
        if tok == eos or len(out) == N_GREEDY:
            return out
        logits = model.forward([tok], len(prompt) + len(out) - 1)


def peer_greedy(llm, prompt: list[int], eos: int) -> list[int]:
    out: list[int] = []
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if tok == eos or len(out) == N_GREEDY:
            break
    return out


def our_decode_tps(model: Model, prompt: list[int], n: int) -> float:
    return bench_ours(model, prompt, n)[1]


def peer_decode_tps(llm, prompt: list[int], n: int) -> float:
    return peer_run(llm, prompt, n)[1]


def prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(name: str, smollm2: Path, llama_cpp, threads: int, greedy_threads: int, reps: int, n_decode: int,
        peer_greedy_from: str) -> dict:
    path = QM.coverage_model(name, smollm2)

    def load(n_threads: int):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=n_threads, n_threads_batch=n_threads,
                              seed=0, verbose=False)
        return llm, Model.load(str(path), threads=n_threads, kv_budget="64MiB")

    # Greedy ids do not depend on the thread count (ggml and our kernels give each row to one
    # thread); on a shared machine 1 thread gets them much sooner.
    llm, model = load(greedy_threads)
    add_bos = fixtures.gguf_add_bos(llm)
    eos = llm.token_eos()
    runs = tokens = total = 0
    if peer_greedy_from == "skip":
        cases = []
    elif peer_greedy_from == "fixture":  # llama.cpp's runs on these same bytes, recorded earlier
        fx = QM.coverage_fixture(name, path)
        cases = [(c["prompt_ids"], c["greedy_ids"]) for c in fx["greedy"]]
    else:
        cases = []
        for _, text in fixtures.greedy_prompts("smollm2-135m"):
            prompt = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
            cases.append((prompt, peer_greedy(llm, prompt, eos)))
    for prompt, theirs in cases:
        ours = our_greedy(model, prompt, eos)
        runs += ours == theirs
        tokens += prefix_len(ours, theirs)
        total += len(theirs)
    prompt = llm.tokenize(fixtures.LOGITS_TEXT.encode("utf-8"), add_bos=add_bos, special=True)[:32]
    if greedy_threads != threads:
        del llm, model
        llm, model = load(threads)
    ours_tps, peer_tps = [], []
    for _ in range(reps):
        ours_tps.append(our_decode_tps(model, prompt, n_decode))
        peer_tps.append(peer_decode_tps(llm, prompt, n_decode))
    del llm, model
    return {"name": name, "model": describe(name), "size_mb": path.stat().st_size / 1e6, "runs": runs,
            "tokens": tokens, "total": total, "ours": statistics.median(ours_tps),
            "peer": statistics.median(peer_tps)}


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--name", "names", multiple=True, default=QM.COVERAGE_NAMES, show_default=True,
              help="A weight type or architecture of tests/quant_models.py (repeatable).")
@click.option("--threads", type=int, default=2, show_default=True, help="For the decode speed.")
@click.option("--greedy-threads", type=int, default=1, show_default=True, help="For the greedy runs.")
@click.option("--reps", type=int, default=3, show_default=True)
@click.option("--peer-greedy", type=click.Choice(("live", "fixture", "skip")), default="live", show_default=True,
              help="llama.cpp's greedy runs: run now, or as recorded in tests/fixtures/llamacpp_coverage_*.json "
                   "(same file bytes, checked by sha256), or skip them (speed only).")
@click.option("--decode", type=int, default=64, show_default=True)
def main(names: tuple[str, ...], threads: int, greedy_threads: int, reps: int, peer_greedy: str,
         decode: int) -> None:
    import llama_cpp

    fixtures.disable_extra_buffer_types(llama_cpp)  # plain ggml-cpu kernels, as the fixtures
    smollm2 = registry.resolve("smollm2-135m")
    print(f"llama-cpp-python {llama_cpp.__version__}; decode: {threads} threads, {decode} tokens "
          f"after 32, median of {reps}; greedy: {N_GREEDY} tokens x 8 prompts "
          f"({greedy_threads} thread(s), llama.cpp's runs: {peer_greedy}); load average {os.getloadavg()[0]:.1f}\n")
    print("| type / arch | test model | MB | greedy runs identical | tokens before first difference "
          "| ours decode tok/s | llama.cpp decode tok/s | ours / llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        r = run(name, smollm2, llama_cpp, threads, greedy_threads, reps, decode, peer_greedy)
        greedy = f"{r['runs']}/8 | {r['tokens']}/{r['total']}" if r["total"] else "- | -"
        print(f"| {r['name']} | {r['model']} | {r['size_mb']:.0f} | {greedy} "
              f"| {r['ours']:.1f} | {r['peer']:.1f} | {r['ours'] / r['peer']:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""Write llama.cpp's answers on the coverage test models (every weight type, qwen2, untied llama).

    python tests/tools/requant_llamacpp_fixtures.py [NAME ...]     # default: all of them

NAME is a weight type (F32 ... IQ4_XS: SmolLM2 requantized by tests/quant_models.py), "qwen2" (the
random-weight qwen2 model) or "llama-untied" (SmolLM2 in Q8_0 with an explicit output.weight).
For each it writes tests/fixtures/llamacpp_coverage_<NAME>.json, everything computed by llama.cpp
through llama-cpp-python (never by rqllm), with the sha256 of the model file it ran on:

* "greedy": the 8 prompts of make_llamacpp_fixtures.py, their ids and llama.cpp's first 32 greedy
  ids with the margin (best minus second-best logit) at every step;
* "logits": for the first 32 tokens of a fixed text (logits_all): top-1 id, logit and margin at
  every position, and the logits of 32 fixed probe ids at every position.

The test models are made deterministically, so CI makes the same bytes and checks our engine
against these files without llama.cpp; a test skips (saying why) if the sha256 differs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_llamacpp_fixtures as base  # noqa: E402

from tests import quant_models  # noqa: E402

N_LOGIT_TOKENS = 32
N_PROBES = 32
PROBE_SEED = 11
NAMES = quant_models.COVERAGE_NAMES


def model_for(name: str) -> Path:
    from engine.registry import resolve

    return quant_models.coverage_model(name, resolve("smollm2-135m"))


def probe_ids(vocab: int) -> list[int]:
    return sorted(int(i) for i in np.random.default_rng(PROBE_SEED).choice(vocab, N_PROBES, replace=False))


def greedy(llm, eos: int, add_bos: bool) -> list[dict]:
    cases = []
    for name, prompt in base.greedy_prompts("smollm2-135m"):
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=True)
        out: list[int] = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok == eos or len(out) == base.N_GREEDY:
                break
        steps = np.array(llm.scores[len(ids) - 1: len(ids) - 1 + len(out)], dtype=np.float32)
        assert list(steps.argmax(axis=-1)) == out, "scores do not line up with the generated ids"
        top2 = np.sort(steps, axis=-1)[:, -2:]
        cases.append({"name": name, "prompt": prompt, "prompt_ids": ids, "greedy_ids": out,
                      "margins": [round(float(m), 4) for m in top2[:, 1] - top2[:, 0]],
                      "greedy_text": llm.detokenize(out).decode("utf-8", errors="replace")})
    return cases


def logits(llm, add_bos: bool) -> dict:
    ids = llm.tokenize(base.LOGITS_TEXT.encode("utf-8"), add_bos=add_bos, special=True)[:N_LOGIT_TOKENS]
    llm.reset()
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    top1 = out.argmax(axis=-1)
    top2 = np.sort(out, axis=-1)[:, -2:]
    probes = probe_ids(out.shape[1])
    return {
        "text": base.LOGITS_TEXT,
        "ids": ids,
        "top1_ids": [int(i) for i in top1],
        "top1_logits": [round(float(out[i, t]), 4) for i, t in enumerate(top1)],
        "margins": [round(float(m), 4) for m in top2[:, 1] - top2[:, 0]],
        "probe_ids": probes,
        "probe_logits": [[round(float(v), 4) for v in row] for row in out[:, probes]],
    }


def make(name: str, llama_cpp, threads: int) -> dict:
    path = model_for(name)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=base.N_CTX, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, seed=0, verbose=False)
    add_bos = base.gguf_add_bos(llm)
    eos = llm.token_eos()
    from gguf import GGUFReader

    types: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    fx = {
        "name": name,
        "file": path.name,
        "sha256": quant_models.file_sha256(path),
        "file_size": path.stat().st_size,
        "tensor_types": types,
        "generator": "tests/tools/requant_llamacpp_fixtures.py",
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "model_params": {"use_extra_bufts": False},
        "settings": {"n_ctx": base.N_CTX, "n_threads": threads, "temperature": 0.0, "top_k": 1,
                     "repeat_penalty": 1.0, "max_tokens": base.N_GREEDY, "stop": "eos", "logits_all": True},
        "add_bos": add_bos,
        "eos_id": eos,
        "greedy": greedy(llm, eos, add_bos),
        "logits": logits(llm, add_bos),
    }
    for case in fx["greedy"]:
        print(f"  {name} {case['name']}: {case['greedy_text'][:50]!r}")
    return fx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", default=NAMES, help=f"any of {' '.join(NAMES)}")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures")
    # ggml splits rows between threads, each row computed whole: the results do not depend on the
    # count, and 1 thread is much faster on a shared, oversubscribed machine
    ap.add_argument("--threads", type=int, default=base.N_THREADS)
    args = ap.parse_args(argv)
    import llama_cpp

    base.disable_extra_buffer_types(llama_cpp)
    for name in args.names:
        if name not in NAMES:
            ap.error(f"unknown name {name!r}")
        base.write(args.out / f"llamacpp_coverage_{name}.json", make(name, llama_cpp, args.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

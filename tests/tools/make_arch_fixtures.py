"""Write llama.cpp's logits on the random-weight architecture models (tests/arch_models.py).

    python tests/tools/make_arch_fixtures.py [NAME ...] [--verbose]   # default: all of them

NAME is one of llama3, llama-yarn, qwen3, gemma2, phi3, qwen3moe, mixtral, olmoe.  For each, llama.cpp (through
llama-cpp-python, never rqllm) evaluates one fixed 48-token sequence (tests.quant_models
.smollm2_text_ids(48): real text in SmolLM2's vocabulary; a BOS first only if the file's
tokenizer.ggml.add_bos_token says so) in one batch with logits_all, n_ctx 512 (so phi3, whose
original_context_length is 32, runs with its rope_factors_long), 2 threads, use_extra_bufts=False,
and tests/fixtures/llamacpp_arch_<NAME>.npz gets:

* ids [48] int32;
* vocab_ids: the sorted union of 4096 vocabulary ids drawn with a fixed seed and every position's
  top-16 ids;
* logits [48, len(vocab_ids)] float32: llama.cpp's logits at those ids;
* top1 [48] and margins [48] (best minus second-best logit), over the full vocabulary;
* n_ctx, sha256 (of the model file), llama_cpp_version, llama_cpp_system_info.

The models are made deterministically, so the tests rebuild the same bytes and compare against
these files without llama.cpp; tests.arch_models.arch_fixture skips (saying why) if the sha256
differs.  Rerun after changing tests/arch_models.py (or quant_models' packers) and commit the npz.
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

from tests import arch_models, quant_models  # noqa: E402

N_CTX = 512
N_THREADS = 2
N_TOKENS = 48
N_RANDOM_IDS = 4096
VOCAB_SEED = 48
TOP_K = 16


def token_ids(add_bos: bool, bos: int) -> list[int]:
    text = quant_models.smollm2_text_ids(N_TOKENS - int(add_bos))
    ids = ([bos] if add_bos else []) + list(text)
    assert len(ids) == N_TOKENS, len(ids)
    return ids


def make(name: str, path: Path, llama_cpp, threads: int, verbose: bool) -> dict:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                          logits_all=True, seed=0, verbose=verbose)
    add_bos = base.gguf_add_bos(llm)
    ids = token_ids(add_bos, llm.token_bos())
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[:N_TOKENS], dtype=np.float32)
    assert logits.shape[0] == N_TOKENS and np.isfinite(logits).all()
    vocab = logits.shape[1]
    random_ids = np.random.default_rng(VOCAB_SEED).choice(vocab, N_RANDOM_IDS, replace=False)
    top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
    vocab_ids = np.union1d(random_ids, top.ravel()).astype(np.int32)
    top2 = np.sort(logits, axis=1)[:, -2:]
    return {
        "ids": np.asarray(ids, dtype=np.int32),
        "vocab_ids": vocab_ids,
        "logits": np.ascontiguousarray(logits[:, vocab_ids]),
        "top1": logits.argmax(axis=1).astype(np.int32),
        "margins": (top2[:, 1] - top2[:, 0]).astype(np.float32),
        "n_ctx": np.int64(N_CTX),
        "sha256": np.str_(quant_models.file_sha256(path)),
        "llama_cpp_version": np.str_(f"llama-cpp-python {llama_cpp.__version__}"),
        "llama_cpp_system_info": np.str_(llama_cpp.llama_print_system_info().decode().strip()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", default=list(arch_models.ARCH_NAMES),
                    help=f"any of {' '.join(arch_models.ARCH_NAMES)}")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures")
    ap.add_argument("--threads", type=int, default=N_THREADS)
    ap.add_argument("--verbose", action="store_true", help="llama.cpp's load log (hparams, rope scaling) on stderr")
    args = ap.parse_args(argv)
    for name in args.names:
        if name not in arch_models.ARCH_NAMES:
            ap.error(f"unknown name {name!r}")
    import llama_cpp

    from engine.registry import resolve

    base.disable_extra_buffer_types(llama_cpp)
    smollm2 = resolve("smollm2-135m")
    failed = []
    for name in args.names:
        path = arch_models.arch_model(name, smollm2)
        try:
            fx = make(name, path, llama_cpp, args.threads, args.verbose)
        except Exception as exc:  # report every model, then fail
            print(f"{name}: llama.cpp failed on {path.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed.append(name)
            continue
        out = args.out / f"llamacpp_arch_{name}.npz"
        np.savez_compressed(out, **fx)
        print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}: "
              f"{len(fx['vocab_ids'])} ids, median margin {float(np.median(fx['margins'])):.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

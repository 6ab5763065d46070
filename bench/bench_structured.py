"""Structured outputs: decode tok/s with a schema against without, the mask's time per token, and the
time to compile a schema.

    python -m bench.bench_structured                          # default model and SmolLM2; 3 runs
    python -m bench.bench_structured --model smollm2-135m --runs 5 --json out.json

Prompts: the extraction prompts of tests/structured_cases.py (six schemas: nested objects, arrays, enums,
bounded numbers, optional fields, patterns), greedy, max_tokens 120, generated with and without their
response_format, modes interleaved prompt by prompt, the prompt cache dropped before each generation.
A mode's tok/s in a run is its decode passes (EOS's included) over its decode seconds; the ratio is the
median over runs of (schema tok/s / free tok/s in the same run); the target is >= 0.9.
The mask time is Constraint.apply's (matcher step, mask, masking the logits) per token, replayed over
the constrained outputs' tokens; it is set against a one-token pass (1 / free tok/s).
Compile time: the schema's grammar and matcher (grammar_for + Constraint), median over the schemas;
the tokenizer's one-time llguidance view (ll_tokenizer, built once per worker) is reported apart.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import numpy as np

from engine.constraint import Constraint, grammar_for, ll_tokenizer
from engine.defaults import DEFAULT_MODEL
from engine.engine import Engine
from engine.params import ResponseFormat, SamplingParams
from tests.structured_cases import SCHEMAS, messages, response_format

ROOT = Path(__file__).resolve().parent.parent

MAX_TOKENS = 120


def tokens_per_second(gens: list) -> float:
    # decode passes, the one that chose EOS included, as Generation.decode_tps counts them:
    # completion_tokens - 1 leaves that pass out, which costs short outputs (a constrained one is
    # ~25 tokens: ~4 %) more than long ones
    decoded = sum(round(g.decode_tps * g.decode_seconds) for g in gens)
    seconds = sum(g.decode_seconds for g in gens)
    return decoded / seconds if seconds > 0 else 0.0


def bench_model(model: str, runs: int, threads: int | None) -> dict:
    eng = Engine(model, threads=threads, kv_budget="64MiB")
    n_vocab = eng.model.cfg.n_vocab
    t0 = time.perf_counter()
    ll_tokenizer(eng.tokenizer, n_vocab)
    tokenizer_s = time.perf_counter() - t0

    compile_s = []
    for name in SCHEMAS:
        fmt = ResponseFormat.model_validate(response_format(name))
        t0 = time.perf_counter()
        Constraint(eng.tokenizer, grammar_for(fmt), n_vocab)
        compile_s.append(time.perf_counter() - t0)

    ratios, free_tps, schema_tps, outputs = [], [], [], {}
    for _ in range(runs):
        free, constrained = [], []
        for name in SCHEMAS:
            for mode in ("free", "schema"):
                eng.forget_cache()
                fmt = response_format(name) if mode == "schema" else None
                gen = eng.generate(messages=messages(name),
                                   params=SamplingParams(max_tokens=MAX_TOKENS, response_format=fmt))
                (constrained if fmt else free).append(gen)
                if fmt:
                    outputs[name] = gen.ids
        f, s = tokens_per_second(free), tokens_per_second(constrained)
        free_tps.append(f)
        schema_tps.append(s)
        ratios.append(s / f if f else 0.0)

    mask_s, steps = 0.0, 0
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    for name, ids in outputs.items():
        c = Constraint(eng.tokenizer, grammar_for(ResponseFormat.model_validate(response_format(name))), n_vocab)
        t0 = time.perf_counter()
        for i in range(len(ids)):
            c.apply(logits, ids[:i])
        mask_s += time.perf_counter() - t0
        steps += len(ids)
    pass_s = 1.0 / statistics.median(free_tps)
    mask_ms = 1000 * mask_s / max(1, steps)
    return {"model": model, "free_tps": round(statistics.median(free_tps), 1),
            "schema_tps": round(statistics.median(schema_tps), 1), "ratio": round(statistics.median(ratios), 3),
            "mask_ms_per_token": round(mask_ms, 3), "mask_share_of_pass": round(mask_ms / 1000 / pass_s, 3),
            "compile_ms_median": round(1000 * statistics.median(compile_s), 2),
            "tokenizer_view_s": round(tokenizer_s, 3)}


@click.command(help=__doc__)
@click.option("--model", "models", multiple=True, default=(DEFAULT_MODEL, "smollm2-135m"), show_default=True,
              help="A model to run (repeatable).")
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--threads", type=int, default=None)
@click.option("--json", "json_out", default=None, help="Also write the results here.")
def main(models: tuple[str, ...], runs: int, threads: int | None, json_out: str | None) -> None:
    results = []
    for model in models:
        r = bench_model(model, runs, threads)
        results.append(r)
        print(f"{model}: free {r['free_tps']} tok/s, schema {r['schema_tps']} tok/s, ratio {r['ratio']} "
              f"(target >= 0.9); mask {r['mask_ms_per_token']} ms/token = {r['mask_share_of_pass']:.1%} of a pass; "
              f"compile {r['compile_ms_median']} ms (tokenizer view, once: {r['tokenizer_view_s']} s)")
    if json_out:
        Path(json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Speculative decoding: decode tok/s with and without, acceptance rates, and the summarise wall time.

    python -m bench.bench_speculative                                  # default model, SmolLM2, Gemma 3; 3 runs
    python -m bench.bench_speculative --model smollm2-135m --runs 5 --draft smollm2-135m=/path/draft.gguf
    python -m bench.bench_speculative --fixed-costs                    # DEFAULT_PASS_COSTS, not timed ones
    python -m bench.bench_speculative --summarize-runs 0 --json out.json

Prompt sets (greedy, as the pipeline runs them):
* summary: the map prompts `rqllm summarize` builds for the document chunks of examples/ (its own
  templates, chunking and parameters: max_tokens 160, repetition penalty 1.1);
* open: open-ended chat prompts (max_tokens 160).
Each run generates every prompt once per mode, modes interleaved prompt by prompt and the prompt
cache dropped before each generation, so machine load drifting between runs hits every mode alike.
A set's decode tok/s in a run is its decoded tokens over its decode seconds; the speedup is the
median over runs of (mode's tok/s / plain tok/s in the same run). Greedy outputs are checked to be
identical across modes (the bench stops otherwise). The summarise benchmark is bench_summarize's
embedded run (1 worker, default budget) with speculative "prompt_lookup" and "off", interleaved.

The lookup ceiling bounds what any prompt lookup could do on a set: the speed-up, at the engine's
pass costs, of a lookup that knew the greedy output and each round checked the best run that follows
an earlier occurrence of the last token (lookup_ceiling). A model that paraphrases its source has a
low ceiling, however good the guessing; verification cost lowers it too.
"""
from __future__ import annotations

import io
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import click

from engine.defaults import DEFAULT_MODEL
from engine.engine import Engine
from engine.params import SamplingParams
from engine.speculative import DEFAULT_PASS_COSTS, MAX_DRAFT

ROOT = Path(__file__).resolve().parent.parent

if TYPE_CHECKING:
    from collections.abc import Sequence

    from engine.params import Generation

OPEN_PROMPTS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how a refrigerator works.",
    "What were the main causes of the French Revolution?",
    "Give me five ideas for a birthday party for a ten-year-old.",
    "Describe a walk through a forest in autumn.",
    "How do I learn to play the guitar as an adult?",
]
MAX_TOKENS = 160


def summary_requests(model: str, capacity: int) -> list[tuple[list[dict], SamplingParams]]:
    """The map prompts of `rqllm summarize examples/`, built by the pipeline's own planning code."""
    from pipeline.summarize import (DEFAULT_MAX_SUMMARY_TOKENS, Budget, PromptMeter, Templates, collect_documents,
                                    plan_document)

    templates = Templates.load(None)
    docs, _ = collect_documents([str(ROOT / "examples")])
    meter = PromptMeter.for_model(model)
    budget = Budget(capacity=capacity, max_summary_tokens=DEFAULT_MAX_SUMMARY_TOKENS)
    params = SamplingParams(max_tokens=DEFAULT_MAX_SUMMARY_TOKENS, repetition_penalty=1.1)
    out = []
    for i, doc in enumerate(docs):
        plan = plan_document(i, doc, run_id="bench", model=model, meter=meter, templates=templates, budget=budget,
                             fan_in=8)
        out.extend((m, params) for m in plan.map_messages)
    return out


def open_requests() -> list[tuple[list[dict], SamplingParams]]:
    return [([{"role": "user", "content": p}], SamplingParams(max_tokens=MAX_TOKENS)) for p in OPEN_PROMPTS]


def lookup_ceiling(prompt: Sequence[int], decided: Sequence[int], pass_cost: Sequence[float],
                   max_draft: int = MAX_DRAFT) -> float:
    """The decode speed-up over plain decoding of the best possible prompt lookup for one generation.

    decided: the tokens greedy decoding decided after the prompt (the first from the prefill's
    logits). At a round with decided[:i] known, a lookup can only propose text that follows an
    earlier occurrence of the last token in prompt + decided[:i] (any longer match is one of those
    too); agree[i] is the longest run of decided[i:] that some such continuation spells. Choosing,
    from i, g <= agree[i] guesses costs pass_cost[g + 1] and decides g + 1 tokens (the last always
    the model's own), so the least total cost is a shortest path over i, solved backwards."""
    full = list(prompt) + list(decided)
    n_prompt, n = len(prompt), len(decided)
    if n < 2:
        return 1.0
    followers: dict[int, list[int]] = defaultdict(list)  # token -> positions right after its occurrences
    for e in range(1, n_prompt):
        followers[full[e - 1]].append(e)
    agree = [0] * n
    for i in range(1, n):
        end = n_prompt + i  # the text so far is full[:end]; its last token is full[end - 1]
        followers[full[end - 2]].append(end - 1)
        room = min(max_draft, n - 1 - i)  # the round's last token is the model's
        best = 0
        for e in followers[full[end - 1]]:
            m = 0
            while m < room and e + m < end and full[e + m] == decided[i + m]:
                m += 1
            best = max(best, m)
            if best == room:
                break
        agree[i] = best
    cost = [0.0] * (n + 1)
    for i in range(n - 1, 0, -1):
        cost[i] = min(pass_cost[g + 1] + cost[i + g + 1] for g in range(agree[i] + 1))
    return (n - 1) / cost[1]


def run_set(eng: Engine, requests, modes: list[str], runs: int, label: str) -> dict:
    """Per mode and run: decoded tokens, decode seconds, guesses and kept guesses over the set."""
    per = {m: [] for m in modes}
    pairs = {m: [] for m in modes}  # per prompt and run: mode's tok/s over plain's, generated back to back
    first: dict[int, Generation] = {}  # prompt -> its first generation: the greedy output every mode must give
    for r in range(runs):
        totals = {m: {"tokens": 0, "seconds": 0.0, "draft": 0, "accepted": 0, "completion": 0} for m in modes}
        for i, (messages, params) in enumerate(requests):
            tps = {}
            for m in modes:
                eng.forget_cache()
                gen = eng.generate(messages=messages, params=params.model_copy(update={"speculative": m}))
                if first.setdefault(i, gen).ids != gen.ids:
                    raise SystemExit(f"{label} prompt {i}: {m} output differs from the first run's greedy output")
                t = totals[m]
                t["tokens"] += round(gen.decode_tps * gen.decode_seconds)  # tokens decided after the first
                t["seconds"] += gen.decode_seconds
                t["draft"] += gen.draft_tokens
                t["accepted"] += gen.accepted_tokens
                t["completion"] += gen.completion_tokens
                tps[m] = gen.decode_tps
            for m in modes:
                if tps[modes[0]] > 0:
                    pairs[m].append(tps[m] / tps[modes[0]])
        for m in modes:
            per[m].append(totals[m])
        line = "  ".join(f"{m} {totals[m]['tokens'] / totals[m]['seconds']:.1f}" for m in modes)
        print(f"  {label} run {r + 1}/{runs}: decode tok/s {line}", file=sys.stderr, flush=True)
    # No stop strings here: "stop" is an end token, which counts as decided (as a sentinel no lookup
    # matches: the ceiling may miss one guess per generation).
    decided = [(g.prompt_ids, g.ids + ([-1] if g.finish_reason == "stop" else [])) for g in first.values()]
    tokens = [len(d) - 1 for _, d in decided]  # the first comes from the prefill
    costs = [t / lookup_ceiling(p, d, eng.pass_costs) for t, (p, d) in zip(tokens, decided)]
    result = {}
    for m in modes:
        tps = [t["tokens"] / t["seconds"] for t in per[m]]
        speed = [a["tokens"] / a["seconds"] / (b["tokens"] / b["seconds"]) for a, b in zip(per[m], per[modes[0]])]
        last = per[m][-1]
        result[m] = {
            "decode_tps_median": round(statistics.median(tps), 1),
            "decode_tps_runs": [round(x, 1) for x in tps],
            "speedup_median": round(statistics.median(speed), 3),
            "paired_speedup_median": round(statistics.median(pairs[m]), 3) if pairs[m] else None,
            "draft_tokens": last["draft"], "accepted_tokens": last["accepted"],
            "acceptance_rate": round(last["accepted"] / last["draft"], 3) if last["draft"] else None,
            "output_from_guesses": round(last["accepted"] / last["completion"], 3) if last["completion"] else 0.0,
            "completion_tokens": last["completion"],
        }
    result["prompt_lookup"]["lookup_ceiling"] = round(sum(tokens) / sum(costs), 3)
    return result


def summarize_wall(model: str, runs: int) -> dict:
    from pipeline.summarize import summarize

    walls: dict[str, list[float]] = {"off": [], "prompt_lookup": []}
    speed = []
    draft = accepted = tokens_out = 0
    for r in range(runs):
        for mode in walls:
            t0 = time.perf_counter()
            report = summarize([str(ROOT / "examples")], output=io.StringIO(), fmt="jsonl", model=model, workers=1,
                               redis_url="", progress_stream=io.StringIO(), speculative=mode)
            walls[mode].append(time.perf_counter() - t0)
            if report.failed:
                raise SystemExit(f"summarize ({mode}): {report.failed} document(s) failed")
            if mode == "prompt_lookup":
                draft = sum(x["draft_tokens"] for x in report.records)
                accepted = sum(x["accepted_tokens"] for x in report.records)
                tokens_out = report.tokens_out
        speed.append(walls["off"][-1] / walls["prompt_lookup"][-1])
        print(f"  summarize run {r + 1}/{runs}: off {walls['off'][-1]:.1f} s, prompt lookup "
              f"{walls['prompt_lookup'][-1]:.1f} s", file=sys.stderr, flush=True)
    return {"wall_off_median": round(statistics.median(walls["off"]), 2),
            "wall_prompt_lookup_median": round(statistics.median(walls["prompt_lookup"]), 2),
            "walls": {k: [round(x, 2) for x in v] for k, v in walls.items()},
            "speedup_median": round(statistics.median(speed), 3),
            "draft_tokens": draft, "accepted_tokens": accepted, "tokens_out": tokens_out}


@click.command(help=__doc__)
@click.option("--model", "models", multiple=True, default=(DEFAULT_MODEL, "smollm2-135m", "gemma3-270m"),
              show_default=True, help="A model to run (repeatable).")
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--draft", "draft_pairs", multiple=True, metavar="MODEL=DRAFT",
              help="Also run speculative='draft' for MODEL with this draft model (repeatable).")
@click.option("--fixed-costs", is_flag=True,
              help="Choose draft lengths with DEFAULT_PASS_COSTS instead of the engine's timed pass costs.")
@click.option("--summarize-runs", type=int, default=3, show_default=True,
              help="Summarise wall-time runs per mode (0: skip).")
@click.option("--json", "json_path", default=None, help="Also write the results here.")
def main(models: tuple[str, ...], runs: int, threads: int, draft_pairs: tuple[str, ...], fixed_costs: bool,
         summarize_runs: int, json_path: str | None) -> None:
    os.environ.pop("REDIS_URL", None)
    drafts = dict(d.split("=", 1) for d in draft_pairs)

    results: dict = {"threads": threads, "cpus": os.cpu_count(), "runs": runs, "models": {}}
    for model in models:
        print(f"{model} ...", file=sys.stderr, flush=True)
        eng = Engine(model, threads=threads, kv_budget="256MiB", draft=drafts.get(model))
        modes = ["off", "prompt_lookup"] + (["draft"] if model in drafts else [])
        res: dict = {}
        if fixed_costs:
            eng.set_speculation_costs(DEFAULT_PASS_COSTS)
        res["summary"] = run_set(eng, summary_requests(model, eng.kv_capacity), modes, runs, "summary")
        res["open"] = run_set(eng, open_requests(), modes, runs, "open")
        res["pass_costs"] = [round(c, 3) for c in eng.pass_costs]
        res["draft_step_cost"] = round(eng.draft.cost_per_guess, 3) if eng.draft is not None else None
        if summarize_runs:
            res["summarize"] = summarize_wall(model, summarize_runs)
        results["models"][model] = res
        del eng

    print(f"\n{threads} threads, {os.cpu_count()} cores (shared machine), medians of {runs} runs; "
          f"decode tok/s over each prompt set, greedy, identical output in every mode")
    print("speedup: median over runs of the set's tok/s over plain's in the same run; paired: median over "
          "prompts x runs of one generation's tok/s over plain's, generated right before it; ceiling: the "
          "best any prompt lookup could do on the set at these pass costs (lookup_ceiling)")
    print(f"{'model':<28} {'prompts':<8} {'mode':<14} {'tok/s':>7} {'speedup':>8} {'paired':>7} {'kept/guessed':>14} "
          f"{'rate':>5} {'from guesses':>12} {'ceiling':>8}")
    for model, res in results["models"].items():
        for kind in ("summary", "open"):
            for mode, r in res[kind].items():
                rate = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
                ceiling = f"{r['lookup_ceiling']:.2f}x" if "lookup_ceiling" in r else "-"
                print(f"{model:<28} {kind:<8} {mode:<14} {r['decode_tps_median']:>7.1f} {r['speedup_median']:>7.2f}x "
                      f"{r['paired_speedup_median']:>6.2f}x "
                      f"{r['accepted_tokens']:>6}/{r['draft_tokens']:<7} {rate:>5} {r['output_from_guesses']:>11.0%} {ceiling:>8}")
        print(f"{model}: pass cost of n = 1..{MAX_DRAFT + 1} tokens over 1 ({'fixed' if fixed_costs else 'timed'})"
              f": {res['pass_costs'][1:]}" + (f"; draft step {res['draft_step_cost']}" if res["draft_step_cost"] else ""))
        if "summarize" in res:
            s = res["summarize"]
            print(f"{model}: rqllm summarize examples/ (1 worker): off {s['wall_off_median']:.1f} s, prompt lookup "
                  f"{s['wall_prompt_lookup_median']:.1f} s ({s['speedup_median']:.2f}x; kept "
                  f"{s['accepted_tokens']}/{s['draft_tokens']} guesses, {s['tokens_out']} tokens out)")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

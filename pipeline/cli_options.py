"""The click options several commands share, declared once: where Redis is, how an engine runs
(threads, KV budget and type, repacking, speculation), what the output must be, and the sampling
flags, generated from engine.params.SamplingParams' fields."""
from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from engine.defaults import DEFAULT_KV_BUDGET
from engine.kv_cache import DEFAULT_KV_TYPE, ENV_KV_TYPE, KV_TYPES
from engine.params import SamplingParams

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def redis_url_option(help: str = "Redis URL (default $REDIS_URL).") -> Decorator:
    return click.option("--redis-url", envvar="REDIS_URL", default=None, help=help)


def threads_option(help: str = "Compute threads (default: $RQLLM_THREADS, else the CPUs this process may use: "
                               "affinity mask and cgroup CPU quota).") -> Decorator:
    return click.option("--threads", type=click.IntRange(1, 1024), default=None, help=help)


def kv_budget_option(help: str, default: str | None = None) -> Decorator:
    """--kv-budget: None leaves the choice to the worker (DEFAULT_KV_BUDGET) or to the command's planner."""
    return click.option("--kv-budget", default=default, show_default=default is not None, help=help)


def workers_option(help: str, *, short: bool = False, min_workers: int = 1) -> Decorator:
    names = ("--workers", "-w") if short else ("--workers",)
    return click.option(*names, type=click.IntRange(min_workers, 64), default=None, help=help)


def no_repack_option(fn=None, *, help: str = "Compute on the GGUF's own weight layout: no repacked (R16) weight "
                                             "cache (also RQLLM_REPACK=0)."):
    """--no-repack: compute on the GGUF's own layout, without the repacked weight cache (engine.repack).
    Used bare (@no_repack_option) or with the command's own help (@no_repack_option(help=...))."""
    option = click.option("--no-repack", "no_repack", is_flag=True, help=help)
    return option(fn) if fn is not None else option


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


def engine_options(fn):
    """--threads, --kv-budget (default DEFAULT_KV_BUDGET) and --kv-type, for a command that loads an engine."""
    fn = threads_option()(fn)
    fn = kv_budget_option("Bytes for the KV cache, e.g. 64MiB, 1GiB; capacity in tokens follows.",
                          default=DEFAULT_KV_BUDGET)(fn)
    return kv_type_option(fn)


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


# Sampling flags: a SamplingParams field's flag is its name with dashes, its type and help come
# from the field, except where the CLI says it differently.
_FLAG_NAMES = {"no_repeat_ngram_size": "--no-repeat-ngram"}
_FLAG_HELP = {
    "temperature": "0 = greedy.",
    "frequency_penalty": "OpenAI's: minus this per earlier use of a token in the generated text.",
    "presence_penalty": "OpenAI's: minus this for a token already in the generated text.",
    "no_repeat_ngram_size": "Never repeat an n-gram of this many tokens of the generated text (0: off).",
    "end_at_sentence": "When --max-tokens cuts the text, end it after its last complete sentence.",
    "stop": "Stop string (repeatable).",
}
_SCALAR_TYPES = {int: int, float: float, int | None: int}


def _sampling_option(name: str, *, defaults: bool) -> Decorator:
    field = SamplingParams.model_fields[name]
    flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    help = _FLAG_HELP.get(name, field.description)
    if field.annotation is bool:
        return click.option(flag, name, is_flag=True, help=help)
    if field.annotation == list[str]:
        return click.option(flag, name, multiple=True, help=help)
    default = field.default if defaults else None
    return click.option(flag, name, type=_SCALAR_TYPES[field.annotation], default=default,
                        show_default=default is not None, help=help)


def sampling_options(*names: str, defaults: bool) -> Decorator:
    """Flags for these SamplingParams fields, handed to the command as one dict, `sampling`.

    defaults=True: each flag defaults to the field's default and `sampling` holds every field (the
    command builds SamplingParams from the flags alone). defaults=False: a flag defaults to nothing
    and `sampling` holds only the flags given, so the rest stay as each job (or its batch line) says."""
    def decorate(fn):
        @functools.wraps(fn)
        def command(*args, **kwargs):
            sampling: dict[str, Any] = {}
            for name in names:
                value = kwargs.pop(name)
                value = list(value) if isinstance(value, tuple) else value
                if defaults or not (value is None or value is False or value == []):  # 0 is a value
                    sampling[name] = value
            return fn(*args, sampling=sampling, **kwargs)

        for name in reversed(names):
            command = _sampling_option(name, defaults=defaults)(command)
        return command

    return decorate


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


def json_schema_options(what: str) -> Decorator:
    """--json-schema FILE and --json-object (response_format_option turns them into a response_format)."""
    def decorate(fn):
        fn = click.option("--json-object", is_flag=True, help=f"Constrain {what} to a JSON object (any).")(fn)
        return click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False),
                            default=None, help=f"Constrain {what} to JSON valid for the JSON schema in this file.")(fn)

    return decorate

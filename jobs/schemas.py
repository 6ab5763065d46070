"""What a producer submits (GenerationJob) and what a worker records (JobResult).

Both are pydantic models that travel through Redis as JSON only. Sampling knobs and the engine's
outcome reuse engine.params (SamplingParams, Generation, FinishReason); nothing here redefines them.

Job ids are derived from the content (model + prompt/messages + sampling params incl. seed, and the
owner when there is one), so the same request submitted twice by the same owner maps to the same rq
job and its finished result is found instead of recomputed. One exception: a *sampled* request
(temperature > 0) without a seed is not reproducible, so its custom_id is mixed into the hash: two
such lines in one file give two independent samples, while resubmitting the same file still finds
them. params.speculative counts only for sampled jobs that set it (greedy output is the same with or
without speculative decoding).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.params import FinishReason, Generation, SamplingParams, TokenLogprob
from jobs import keys
from jobs.defaults import DEFAULT_PRIORITY, PRIORITIES, RESULT_TTL, STREAM_TTL

ID_VERSION = "v1"
ENDPOINT_CHAT = "/v1/chat/completions"
ENDPOINT_COMPLETIONS = "/v1/completions"
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]

_MODEL_KEY_RE = re.compile(r"[^a-z0-9._-]+")
# A model is named by a registry-style name or by a path to a .gguf file (keyed by the file's stem);
# nothing else ever becomes a queue name (rq:queue:rqllm:<key>:<priority>).
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_KEY_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")

# Prompts are refused at submission above this size (UTF-8 bytes, all chat messages together): no
# KV budget here holds more than a few hundred KB of text, and a 50 MB prompt must not travel through
# Redis to be tokenized by a worker only to fail there. Override with the environment variable.
MAX_PROMPT_BYTES_ENV = "RQLLM_MAX_PROMPT_BYTES"
DEFAULT_MAX_PROMPT_BYTES = 1 << 20


def max_prompt_bytes() -> int:
    raw = os.environ.get(MAX_PROMPT_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_PROMPT_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise InvalidJob(f"{MAX_PROMPT_BYTES_ENV}={raw!r} is not a number of bytes") from None
    return value if value > 0 else DEFAULT_MAX_PROMPT_BYTES


def _check_text(what: str, text: str) -> None:
    """Valid UTF-8 (JSON's \\ud800 escapes give lone surrogates, which no tokenizer can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text: {e.reason} ({text[e.start]!r}) at character "
                         f"{e.start}") from None


def _text_bytes(text: str, limit: int) -> int:
    """UTF-8 size of text; a cheap lower bound when that already exceeds the limit."""
    if len(text) > limit:
        return len(text)  # every character is at least one byte: no need to encode megabytes
    return len(text.encode("utf-8", "surrogatepass"))


def _check_size(what: str, size: int, limit: int) -> None:
    if size > limit:
        raise ValueError(f"{what} {size:,} bytes, over the limit of {limit:,} bytes "
                         f"(set {MAX_PROMPT_BYTES_ENV} to change it)")


# SamplingParams fields added after v1 ids were in use, with the default that leaves them out of the id.
_PARAMS_ADDED_LATER: dict[str, Any] = {"frequency_penalty": 0.0, "presence_penalty": 0.0,
                                       "no_repeat_ngram_size": 0, "end_at_sentence": False, "logprobs": None,
                                       "response_format": None}


class InvalidJob(ValueError):
    """A job refused at submission; the message names the bad field as a request names it ("max_tokens:
    Input should be ..."), and `param` is that field's path in OpenAI's form (the API's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestMessage(BaseModel):
    """One chat turn as a request carries it: OpenAI-style content parts ([{"type": "text", "text": ...}])
    are joined to text, and a `name` is allowed. The engine renders its own form of it
    (engine.chat.ChatMessage: role and text only)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, v: Any) -> Any:
        if isinstance(v, list):
            parts = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return v

    @field_validator("content")
    @classmethod
    def _content_is_text(cls, v: str) -> str:
        limit = max_prompt_bytes()
        _check_size("message content is", _text_bytes(v, limit), limit)
        _check_text("message content", v)
        return v


class GenerationJob(BaseModel):
    """One generation request: a raw `prompt` (completions) or chat `messages`, never both."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, description="content-derived; computed when absent")
    model: str = Field(..., min_length=1, max_length=512)
    prompt: str | None = None
    messages: list[RequestMessage] | None = Field(None, min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    custom_id: str | None = Field(None, max_length=512)
    batch_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    # Who asked: a non-reversible id of the API key (pipeline.api.auth), None for producers without
    # one (the CLI). Part of the id, so jobs, stored results and cancellation are never shared across
    # owners; the worker reuses a cached prompt prefix only for the same owner.
    owner: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")

    @field_validator("model")
    @classmethod
    def _model_names_a_queue(cls, v: str) -> str:
        model_key(v)  # InvalidJob (a ValueError) names what is wrong
        return v

    @field_validator("params", mode="before")
    @classmethod
    def _strict_params(cls, v: Any) -> Any:
        """JSON's types as they are (pydantic's strict mode): `true` is not 1, "0.5" is not 0.5."""
        if isinstance(v, dict):
            return SamplingParams.model_validate(v, strict=True)
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: str | None) -> str | None:
        if v is None:
            return v
        limit = max_prompt_bytes()
        _check_size("prompt is", _text_bytes(v, limit), limit)  # first: a huge prompt costs nothing more
        if not v.strip():
            raise ValueError("prompt must not be empty" + (" (it is only whitespace)" if v else ""))
        _check_text("prompt", v)
        return v

    @field_validator("messages")
    @classmethod
    def _messages_size(cls, v: list[RequestMessage] | None) -> list[RequestMessage] | None:
        if v is not None:
            limit = max_prompt_bytes()
            _check_size("the chat messages together are", sum(_text_bytes(m.content, limit) for m in v), limit)
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_is_json(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata must be JSON-serialisable: {e}") from None
        return v

    @model_validator(mode="after")
    def _one_input_and_id(self) -> GenerationJob:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        expected = self.content_id()
        if self.id is None:
            self.id = expected
        elif self.id != expected:
            raise ValueError(f"id {self.id!r} does not match the job's content (expected {expected!r})")
        return self

    @property
    def endpoint(self) -> str:
        return ENDPOINT_CHAT if self.messages is not None else ENDPOINT_COMPLETIONS

    def content_key(self) -> dict[str, Any]:
        """What the id hashes: everything that can change the generated text."""
        params = self.params.model_dump(mode="json")
        # Knobs added after ids were first handed out count only when set: a job that leaves them
        # at their defaults keeps the id (and finds the result) it had before they existed.
        for name, default in _PARAMS_ADDED_LATER.items():
            if params.get(name) == default:
                params.pop(name)
        # How tokens are guessed changes nothing in greedy output, and nothing when left to the
        # worker: the id (and a finished result) is shared then; a sampled run's draws differ.
        if params.get("speculative") is None or self.params.temperature == 0:
            params.pop("speculative", None)
        key: dict[str, Any] = {
            "v": ID_VERSION,
            "model": model_key(self.model),
            "params": params,
        }
        if self.messages is not None:
            key["messages"] = [m.model_dump(mode="json", exclude_none=True) for m in self.messages]
        else:
            key["prompt"] = self.prompt
        if self.params.temperature > 0 and self.params.seed is None:
            key["custom_id"] = self.custom_id
        if self.owner is not None:  # absent for owner None: the CLI's ids (and stored results) stay as they were
            key["owner"] = self.owner
        return key

    def content_id(self) -> str:
        blob = json.dumps(self.content_key(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return "g" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:40]

    def to_payload(self) -> dict[str, Any]:
        """The JSON dict that rq carries as the task argument."""
        return self.model_dump(mode="json", exclude_none=True)


class JobError(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    message: str


class TaskOptions(BaseModel):
    """Per-submission options carried next to the job (not part of its content id)."""

    model_config = ConfigDict(extra="forbid")

    result_ttl: int = Field(RESULT_TTL, ge=1)
    stream_ttl: int = Field(STREAM_TTL, ge=1)


class JobResult(BaseModel):
    """What a worker records when a job ends (done or failed). Stored as JSON in Redis."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    status: Literal["done", "failed"]
    model: str = ""
    endpoint: str = ENDPOINT_COMPLETIONS
    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefix_hit_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: guesses checked / kept (engine.params.Generation)
    accepted_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # params.logprobs: one per generated token (engine.logprobs)
    worker: str | None = None
    attempt: int = 1
    started_at: float | None = None
    ended_at: float = Field(default_factory=time.time)
    error: JobError | None = None

    @classmethod
    def from_generation(cls, job: GenerationJob, gen: Generation, **kw: Any) -> JobResult:
        kw.setdefault("job_id", job.id)
        kw.setdefault("model", job.model)
        kw.setdefault("endpoint", job.endpoint)
        return cls(
            status="done",
            text=gen.text,
            finish_reason=gen.finish_reason,
            prompt_tokens=gen.prompt_tokens,
            completion_tokens=gen.completion_tokens,
            prefill_seconds=gen.prefill_seconds,
            decode_seconds=gen.decode_seconds,
            prefix_hit_tokens=gen.prefix_hit_tokens,
            draft_tokens=gen.draft_tokens,
            accepted_tokens=gen.accepted_tokens,
            logprobs=gen.logprobs,
            **kw,
        )

    @classmethod
    def failed(cls, job_id: str, code: str, message: str, **kw: Any) -> JobResult:
        return cls(job_id=job_id, status="failed", error=JobError(code=code, message=message), **kw)


def validate_job(data: GenerationJob | dict[str, Any]) -> GenerationJob:
    """Parse a job, raising InvalidJob (describe_errors' message, the first bad field's param) when it is refused."""
    if isinstance(data, GenerationJob):
        # Re-validate: a model built with model_construct() or mutated afterwards is not trusted.
        data = data.model_dump(mode="python")
    try:
        return GenerationJob.model_validate(data)
    except ValidationError as e:
        raise invalid_job(e) from None


def invalid_job(e: ValidationError) -> InvalidJob:
    errors = e.errors(include_url=False)
    return InvalidJob(describe_errors(e), param=error_param(errors[0]["loc"]) if errors else None)


def error_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """A pydantic error location as a request names the field, in OpenAI's `param` form: the sampling
    knobs are top-level body fields ("max_tokens", not "params.max_tokens"), list items are "[i]"
    ("messages.[0].role"). None for an error of the whole request."""
    parts = list(loc)
    if len(parts) > 1 and parts[0] == "params":
        parts = parts[1:]
    return ".".join(f"[{x}]" if isinstance(x, int) else str(x) for x in parts) or None


def describe_errors(e: ValidationError) -> str:
    """pydantic's errors in one line, each naming its field as error_param does, without pydantic's
    header and links: 'top_p: Input should be less than or equal to 1 (got 1.5)'. The one wording of a
    refused field everywhere (submit, batch files, the API, generate, a worker's invalid_request)."""
    lines = []
    for err in e.errors(include_url=False):
        where = error_param(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        got = ""
        if err["type"] not in ("value_error", "missing") and not isinstance(err.get("input"), (dict, list)):
            shown = repr(err.get("input"))
            got = f" (got {shown[:60]}{'...' if len(shown) > 60 else ''})"
        lines.append(f"{where}: {msg}{got}" if where else f"{msg}{got}")
    return "; ".join(lines)


def model_key(model: str) -> str:
    """The name a model's queues are keyed by: a registry name as is, a .gguf path by its file stem.

    Producers and workers must name the model the same way (both derive the queue from this).
    """
    m = model.strip()
    if m.lower().endswith(".gguf"):
        key = _MODEL_KEY_RE.sub("-", Path(m).name[: -len(".gguf")].lower()).strip("-")
    elif MODEL_NAME_RE.fullmatch(m):
        key = m.lower()
    else:
        shown = repr(model) if len(model) <= 80 else repr(model[:80]) + "..."
        raise InvalidJob(f"model {shown} is neither a model name (letters, digits, '.', '_' or '-', at most 128, "
                         "starting with a letter or digit) nor a path to a .gguf file")
    if not MODEL_KEY_RE.fullmatch(key):
        raise InvalidJob(f"model {model!r}: the .gguf file's name gives no valid queue name")
    return key


def queue_name(model: str, priority: str = DEFAULT_PRIORITY) -> str:
    """rq queue name for a model and priority: rqllm:<model>:<priority> (rq key rq:queue:<name>)."""
    if priority not in PRIORITIES:
        raise InvalidJob(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    return keys.queue_name(model_key(model), priority)


def queue_names(model: str) -> list[str]:
    """A worker's queues, highest priority first."""
    return [queue_name(model, p) for p in PRIORITIES]

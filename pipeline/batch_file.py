"""OpenAI Batch files: input lines -> GenerationJob (results -> output lines: pipeline/openai_format.py).

Input line: {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
             "body": {"model": ..., "messages": [...] | "prompt": ..., "max_tokens": ..., "temperature": ...,
                      "top_p": ..., "seed": ..., "stop": ...,
                      "logprobs": ..., "top_logprobs": ... (chat: true/false and 0..20; completions: 0..5),
                      "response_format": {"type": "json_object"} | {"type": "json_schema", "json_schema":
                          {"name", "schema", "strict"}} | {"type": "regex", "regex": ...} (rqllm's),
                      "speculative": "off" | "prompt_lookup" | "draft" (rqllm's; default: the worker's)}}
Output line: {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200, "request_id": ...,
              "body": <chat.completion | text_completion>} | null, "error": {"code", "message"} | null}
Output order is completion order; custom_id is the key.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from jobs.schemas import (
    ENDPOINT_CHAT,
    ENDPOINT_COMPLETIONS,
    MAX_PROMPT_BYTES_ENV,
    GenerationJob,
    InvalidJob,
    invalid_job,
    max_prompt_bytes,
    validate_job,
)
from engine.defaults import DEFAULT_MODEL


# body fields mapped onto SamplingParams (OpenAI's, top_k/min_p/repetition_penalty as vLLM accepts
# them; speculative, no_repeat_ngram_size and end_at_sentence are rqllm's own)
_PARAM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "no_repeat_ngram_size", "end_at_sentence", "seed", "speculative")
# accepted only with a value that changes nothing
_NEUTRAL = {
    "n": (1,),
    "stream": (False,),
    "echo": (False,),
    "best_of": (1,),
}
# OpenAI's ranges, narrower than what the engine takes (`rqllm generate --temperature` goes to 10)
MAX_TEMPERATURE = 2
MAX_TOP_LOGPROBS = 20  # chat completions' top_logprobs
MAX_COMPLETIONS_LOGPROBS = 5  # completions' logprobs
_IGNORED = {"user", "metadata", "store", "service_tier"}
# No request needs more (messages -> content parts -> part is 4 levels); deeper JSON is refused
# before anything recurses over it (json.loads itself stops near 1000 levels with a RecursionError).
MAX_JSON_DEPTH = 32

# LineError codes (the `code` of a refused line's error in an output or error file)
INVALID_REQUEST = "invalid_request"
MODEL_NOT_FOUND = "model_not_found"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"

# A model the caller can serve: None, or why not (pipeline.model_check.ModelCheck)
ModelChecker = Callable[[str], "str | None"]


@dataclass
class LineError:
    lineno: int
    custom_id: str | None
    message: str
    code: str = INVALID_REQUEST
    param: str | None = None  # the refused field, in OpenAI's form (jobs.schemas.error_param)

    def __str__(self) -> str:
        cid = f" ({self.custom_id})" if self.custom_id else ""
        code = f"{self.code}: " if self.code != INVALID_REQUEST else ""
        return f"line {self.lineno}{cid}: {code}{self.message}"


@dataclass
class Refused:
    """An input line (or prompt) refused at submission. Kept with its batch (Client.submit_batch), so the
    batch's results hold an error line for it with its custom_id, as the API's error file does, and the
    batch's counts include it as the API's request_counts do."""
    custom_id: str | None
    code: str
    message: str
    line: int | None = None  # its line number in `file`
    file: str | None = None  # the input file it came from (rqllm submit takes several)
    param: str | None = None

    @classmethod
    def from_line_error(cls, e: LineError, file: str | None = None) -> Refused:
        return cls(e.custom_id, e.code, e.message, e.lineno, file, e.param)

    def as_dict(self) -> dict[str, Any]:
        return {"custom_id": self.custom_id, "code": self.code, "message": self.message, "line": self.line,
                "file": self.file, "param": self.param}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Refused:
        return cls(d.get("custom_id"), str(d.get("code") or INVALID_REQUEST), str(d.get("message") or ""),
                   d.get("line"), d.get("file"), d.get("param"))

    def __str__(self) -> str:
        where = (f"{self.file}: " if self.file else "") + (f"line {self.line}" if self.line is not None else "")
        cid = self.custom_id or ""
        if where and cid:
            where += f" ({cid})"
        elif cid:
            where = cid
        code = f"{self.code}: " if self.code != INVALID_REQUEST else ""
        return f"{where}: {code}{self.message}" if where else f"{code}{self.message}"


def refused_output_line(batch_id: str, index: int, refused: Refused) -> dict[str, Any]:
    """The output line of a batch's index-th refused line: no response, its error (code, message, param, line)."""
    rid = "batch_req_" + hashlib.sha256(f"{batch_id}\0refused\0{index}".encode()).hexdigest()[:24]
    error: dict[str, Any] = {"code": refused.code, "message": refused.message, "param": refused.param,
                             "line": refused.line}
    if refused.file:
        error["file"] = refused.file
    return {"id": rid, "custom_id": refused.custom_id, "response": None, "error": error}


def json_depth(obj: Any) -> int:
    """How deeply arrays and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, list):
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        stack.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))
    return deepest


def too_deep_message() -> str:
    return f"JSON nested more than {MAX_JSON_DEPTH} levels deep"


def loads_json(text: str | bytes) -> Any:
    """json.loads, with JSON nested deeper than MAX_JSON_DEPTH refused (InvalidJob) instead of a
    RecursionError; json.JSONDecodeError as json.loads raises it."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise InvalidJob(too_deep_message()) from None
    if json_depth(obj) > MAX_JSON_DEPTH:
        raise InvalidJob(too_deep_message())
    return obj


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    """`value` is one of `allowed` with the same JSON type (true is not 1, 1.0 is not 1)."""
    return any(type(value) is type(a) and value == a for a in allowed)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_count(v: Any, top: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= top


def _logprobs(body: dict[str, Any], url: str) -> int | None:
    """SamplingParams.logprobs from OpenAI's fields: chat's `logprobs` (true/false) and `top_logprobs`
    (0..20, only with logprobs true); completions' `logprobs` (0..5 alternatives)."""
    want = body.get("logprobs")
    if url == ENDPOINT_CHAT:
        top = body.get("top_logprobs")
        if want is not None and not isinstance(want, bool):
            raise InvalidJob(f"logprobs: Input should be true or false (got {want!r})", param="logprobs")
        if top is not None:
            if not _is_count(top, MAX_TOP_LOGPROBS):
                raise InvalidJob(f"top_logprobs: Input should be an integer from 0 to {MAX_TOP_LOGPROBS} (got {top!r})",
                                 param="top_logprobs")
            if not want:
                raise InvalidJob("top_logprobs: logprobs must be true when top_logprobs is given", param="top_logprobs")
        return (top or 0) if want else None
    if want is None:
        return None
    if not _is_count(want, MAX_COMPLETIONS_LOGPROBS):
        raise InvalidJob(f"logprobs: Input should be an integer from 0 to {MAX_COMPLETIONS_LOGPROBS} (got {want!r})",
                         param="logprobs")
    return want


def line_model(obj: Any, *, model: str | None = None, default_model: str = DEFAULT_MODEL) -> Any:
    """The model a parsed input line names (as request_to_job picks it)."""
    body = obj.get("body") if isinstance(obj, dict) else None
    return model or (body.get("model") if isinstance(body, dict) else None) or default_model


def request_to_job(obj: Any, *, model: str | None = None, default_model: str = DEFAULT_MODEL) -> GenerationJob:
    """One parsed input line -> a validated GenerationJob (InvalidJob names what is wrong).

    `model` overrides body.model; otherwise body.model, else `default_model`.
    """
    if not isinstance(obj, dict):
        raise InvalidJob("a line must be a JSON object")
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise InvalidJob(f"unknown top-level field(s): {', '.join(sorted(unknown))}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidJob("custom_id must be a non-empty string", param="custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        raise InvalidJob(f"method must be POST, not {method!r}", param="method")
    url = obj.get("url")
    if url not in (ENDPOINT_CHAT, ENDPOINT_COMPLETIONS):
        raise InvalidJob(f"url must be {ENDPOINT_CHAT} or {ENDPOINT_COMPLETIONS}, not {url!r}", param="url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise InvalidJob("body must be a JSON object", param="body")
    if json_depth(body) > MAX_JSON_DEPTH:  # a body parsed elsewhere (an HTTP request's)
        raise InvalidJob("body: " + too_deep_message())

    params: dict[str, Any] = {}
    bad: list[str] = []
    for k, v in body.items():
        if k in ("model", "messages", "prompt", "logprobs") or (k == "top_logprobs" and url == ENDPOINT_CHAT):
            continue
        if k in ("max_tokens", "max_completion_tokens"):
            if v is not None:
                params["max_tokens"] = v
        elif k in _PARAM_FIELDS:
            if v is not None:
                params[k] = v
        elif k == "response_format":
            # compiled here (engine.params.ResponseFormat): a schema that cannot be is refused with its line
            if v is not None:
                params["response_format"] = v
        elif k == "stop":
            if v is not None:
                params["stop"] = [v] if isinstance(v, str) else v
        elif k in _NEUTRAL:
            if not _neutral(v, _NEUTRAL[k]):
                bad.append(f"{k}={v!r}")
        elif k not in _IGNORED:
            bad.append(k)
    if bad:
        raise InvalidJob(f"unsupported body field(s): {', '.join(bad)}", param=bad[0].split("=", 1)[0])
    temperature = params.get("temperature")
    if _is_number(temperature) and temperature > MAX_TEMPERATURE:
        raise InvalidJob(f"temperature: Input should be less than or equal to {MAX_TEMPERATURE} (got {temperature!r})",
                         param="temperature")
    logprobs = _logprobs(body, url)
    if logprobs is not None:
        params["logprobs"] = logprobs

    job: dict[str, Any] = {
        "model": model or body.get("model") or default_model,
        "custom_id": custom_id,
        "params": params,
    }
    if url == ENDPOINT_CHAT:
        if "prompt" in body:
            raise InvalidJob(f"{ENDPOINT_CHAT} takes `messages`, not `prompt`", param="prompt")
        if "messages" not in body:
            raise InvalidJob(f"{ENDPOINT_CHAT} needs `messages`", param="messages")
        job["messages"] = body["messages"]
    else:
        if "messages" in body:
            raise InvalidJob(f"{ENDPOINT_COMPLETIONS} takes `prompt`, not `messages`", param="messages")
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise InvalidJob("prompt must be a string (or a list of exactly one string)", param="prompt")
            prompt = prompt[0]
        if prompt is None:
            raise InvalidJob(f"{ENDPOINT_COMPLETIONS} needs `prompt`", param="prompt")
        job["prompt"] = prompt
    return validate_job(job)


LINE_ENVELOPE_BYTES = 64 << 10  # what a request line may hold besides its prompt (custom_id, params...)


def parse_lines(lines: Iterable[str | bytes], *, model: str | None = None, default_model: str = DEFAULT_MODEL,
                endpoint: str | None = None, check_model: ModelChecker | None = None
                ) -> tuple[list[GenerationJob], list[LineError]]:
    """Parse an input file's lines (str, or bytes as read from the file); bad lines are reported with
    their number, the others kept. With `endpoint`, a line whose url names another endpoint is bad
    (an OpenAI batch serves one endpoint). With `check_model`, a line naming a model it refuses is bad
    with code model_not_found. A custom_id used again is bad with code duplicate_custom_id."""
    jobs: list[GenerationJob] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    line_limit = max_prompt_bytes() + LINE_ENVELOPE_BYTES
    for lineno, line in enumerate(lines, 1):
        if len(line) > line_limit:
            # refused before parsing: a 50 MB line costs one length check
            size = len(line) if isinstance(line, bytes) else len(line.encode("utf-8", "surrogatepass"))
            errors.append(LineError(lineno, None, f"line is {size:,} bytes, over the limit of {line_limit:,} bytes "
                                    f"for one request (prompt limit {line_limit - LINE_ENVELOPE_BYTES:,} + "
                                    f"{LINE_ENVELOPE_BYTES:,}; set {MAX_PROMPT_BYTES_ENV} to change it)"))
            continue
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append(LineError(lineno, None, f"not valid UTF-8: {e.reason} (byte {line[e.start]:#04x} at "
                                        f"byte {e.start} of the line)"))
                continue
        if not line.strip():
            continue
        cid = None
        try:
            obj = loads_json(line)
            cid = obj.get("custom_id") if isinstance(obj, dict) else None
            if endpoint is not None and isinstance(obj, dict) and obj.get("url") != endpoint:
                raise InvalidJob(f"url {obj.get('url')!r} is not this batch's endpoint {endpoint}", param="url")
            named = line_model(obj, model=model, default_model=default_model)
            why = check_model(named) if check_model is not None and isinstance(named, str) else None
            if why is not None:
                errors.append(LineError(lineno, cid if isinstance(cid, str) else None, why, MODEL_NOT_FOUND, "model"))
                continue
            job = request_to_job(obj, model=model, default_model=default_model)
        except json.JSONDecodeError as e:
            errors.append(LineError(lineno, None, f"invalid JSON: {e}"))
            continue
        except (InvalidJob, ValidationError) as e:
            bad = e if isinstance(e, InvalidJob) else invalid_job(e)
            errors.append(LineError(lineno, cid if isinstance(cid, str) else None, str(bad), param=bad.param))
            continue
        if job.custom_id in seen:
            errors.append(LineError(lineno, job.custom_id, f"custom_id already used on line {seen[job.custom_id]}",
                                    DUPLICATE_CUSTOM_ID, "custom_id"))
            continue
        seen[job.custom_id] = lineno
        jobs.append(job)
    return jobs, errors


def read_batch_file(path: str | Path, *, model: str | None = None, default_model: str = DEFAULT_MODEL,
                    endpoint: str | None = None, check_model: ModelChecker | None = None
                    ) -> tuple[list[GenerationJob], list[LineError]]:
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is reported, not fatal for the file
        return parse_lines(f, model=model, default_model=default_model, endpoint=endpoint, check_model=check_model)

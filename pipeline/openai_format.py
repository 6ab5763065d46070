"""OpenAI's response shapes, built here only: JobResult -> the chat.completion / text_completion body
(with logprobs and usage), the streamed chunks of the same (chat.completion.chunk, text_completion), and
OpenAI Batch output lines (the input format: pipeline/batch_file.py)."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from jobs.schemas import ENDPOINT_CHAT, JobResult


def usage(r: JobResult) -> dict[str, int]:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens}


def response_id(job_id: str, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + job_id


def chat_logprobs(result: JobResult) -> dict[str, Any] | None:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    if result.logprobs is None:
        return None
    return {"content": [t.model_dump() for t in result.logprobs], "refusal": None}


def completion_logprobs(result: JobResult) -> dict[str, Any] | None:
    """A text completion choice's `logprobs`, OpenAI's legacy form: tokens, token_logprobs, top_logprobs
    (a {token: logprob} object per token) and text_offset (where each token starts in the text)."""
    if result.logprobs is None:
        return None
    offsets, at = [], 0
    for t in result.logprobs:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in result.logprobs], "token_logprobs": [t.logprob for t in result.logprobs],
            "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs} for t in result.logprobs],
            "text_offset": offsets}


def response_body(result: JobResult) -> dict[str, Any]:
    """The chat.completion / text_completion object for a done result."""
    created = int(result.ended_at)
    extra = {"job_id": result.job_id, "worker": result.worker, "attempt": result.attempt,
             "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
             "prefix_hit_tokens": result.prefix_hit_tokens, "draft_tokens": result.draft_tokens,
             "accepted_tokens": result.accepted_tokens}
    if result.endpoint == ENDPOINT_CHAT:
        return {
            "id": response_id(result.job_id, True),
            "object": "chat.completion",
            "created": created,
            "model": result.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": chat_logprobs(result), "finish_reason": result.finish_reason}],
            "usage": usage(result),
            "rqllm": extra,
        }
    return {
        "id": response_id(result.job_id, False),
        "object": "text_completion",
        "created": created,
        "model": result.model,
        "choices": [{"index": 0, "text": result.text, "logprobs": completion_logprobs(result),
                     "finish_reason": result.finish_reason}],
        "usage": usage(result),
        "rqllm": extra,
    }


def stream_chunk(job_id: str, model: str, created: int, chat: bool, content: str | None, *, role: bool = False,
                 finish: str | None = None, logprobs: dict[str, Any] | None = None,
                 include_usage: bool = False) -> dict[str, Any]:
    """One streamed chunk: a chat.completion.chunk (its delta: the role in the first, then content) or a
    text_completion. include_usage: the chunk carries "usage": null (OpenAI's, when the client asked for
    usage: every chunk has the field, set only in usage_chunk)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if content is not None:
            delta["content"] = content
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj: dict[str, Any] = {"id": response_id(job_id, True), "object": "chat.completion.chunk", "created": created,
                               "model": model, "system_fingerprint": None, "choices": [choice]}
    else:
        obj = {"id": response_id(job_id, False), "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": content or "", "logprobs": logprobs, "finish_reason": finish}]}
    if include_usage:
        obj["usage"] = None
    return obj


def usage_chunk(job_id: str, model: str, created: int, chat: bool, result: JobResult) -> dict[str, Any]:
    """The last streamed chunk when the client asked for usage: no choices, the usage."""
    return {"id": response_id(job_id, chat), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage(result)}


def output_line(batch_id: str, custom_id: str, result: JobResult | None, job_id: str | None = None) -> dict[str, Any]:
    """One OpenAI Batch output line (a dict; json.dumps it)."""
    rid = "batch_req_" + hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:24]
    if result is None:
        return {"id": rid, "custom_id": custom_id, "response": None,
                "error": {"code": "missing_result", "message": f"no result recorded for job {job_id}"}}
    if result.status == "done":
        return {"id": rid, "custom_id": custom_id,
                "response": {"status_code": 200, "request_id": result.job_id, "body": response_body(result)},
                "error": None}
    err = result.error.model_dump() if result.error else {"code": "failed", "message": "failed"}
    return {"id": rid, "custom_id": custom_id, "response": None, "error": err}


def dump_line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

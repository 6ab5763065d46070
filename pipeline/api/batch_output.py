"""A batch's working files under <data dir>/batches/<id>/ and the output and error files made from them.

    rejected.jsonl   error lines for input lines refused at validation (written before submission)
    collected.jsonl  the collector's output (pipeline.collector: resumable, one line per request)

When the batch ends, the successful lines go to the output file and the failed ones (refused, failed
in a worker, cancelled or expired before running) to the error file: every input line is in exactly
one of them, keyed by custom_id. The files hold what an API client may see (client_line): the
collector's lines also name the worker, its timings and prefix-cache hits, which stay with operators.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.files import atomic_write
from pipeline.batch_file import LineError
from pipeline.openai_format import dump_line, output_line


# The rqllm fields of a response body an API client sees. The others (worker, attempt, prefill and
# decode times, prefix-cache hits, speculative counts) describe the worker's state, which other
# keys' requests shaped: they stay in the job records (`rqllm status`, `rqllm collect`) and logs.
CLIENT_RQLLM_FIELDS = ("job_id",)


def client_body(body: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion / text_completion body with only the rqllm fields a client may see."""
    extra = body.get("rqllm")
    if not isinstance(extra, dict):
        return body
    return {**body, "rqllm": {k: extra[k] for k in CLIENT_RQLLM_FIELDS if k in extra}}


def client_line(line: dict[str, Any]) -> dict[str, Any]:
    """An output line as an API client may see it (client_body for its response's body)."""
    response = line.get("response")
    if not isinstance(response, dict) or not isinstance(response.get("body"), dict):
        return line
    return {**line, "response": {**response, "body": client_body(response["body"])}}


def rejected_line(batch_id: str, error: LineError) -> dict[str, Any]:
    key = error.custom_id if error.custom_id is not None else f"line {error.lineno}"
    rid = "batch_req_" + hashlib.sha256(f"{batch_id}\0{key}".encode()).hexdigest()[:24]
    return {"id": rid, "custom_id": error.custom_id, "response": None,
            "error": {"code": "invalid_request", "message": str(error), "param": error.param, "line": error.lineno}}


def unfinished_line(batch_id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A request that never ran (the batch was cancelled or expired before it was submitted)."""
    line = output_line(batch_id, custom_id, None)
    line["error"] = {"code": code, "message": message}
    return line


def write_jsonl_atomic(path: Path, lines: Iterable[dict[str, Any]]) -> None:
    with atomic_write(path, "w", durable=True) as out:
        for line in lines:
            out.write(dump_line(line) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Whole lines only: a torn last line (a crash mid-write) is left to the collector to cut off."""
    if not path.exists():
        return []
    out = []
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n") or not raw.strip():
                continue
            try:
                out.append(json.loads(raw))
            except ValueError:
                break
    return out


def succeeded(line: dict[str, Any]) -> bool:
    return line.get("error") is None and line.get("response") is not None


@dataclass
class Tally:
    """request_counts and usage of a set of output lines."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def add(self, line: dict[str, Any]) -> Tally:
        if succeeded(line):
            self.completed += 1
            usage = ((line.get("response") or {}).get("body") or {}).get("usage") or {}
            self.input_tokens += int(usage.get("prompt_tokens") or 0)
            self.output_tokens += int(usage.get("completion_tokens") or 0)
        else:
            self.failed += 1
        return self

    def as_counts(self) -> dict[str, int]:
        return {"completed": self.completed, "failed": self.failed, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens}


@dataclass
class BatchWorkDir:
    root: Path
    batch_id: str

    @property
    def rejected_path(self) -> Path:
        return self.root / "rejected.jsonl"

    @property
    def collected_path(self) -> Path:
        return self.root / "collected.jsonl"

    def write_rejected(self, errors: list[LineError]) -> list[dict[str, Any]]:
        lines = [rejected_line(self.batch_id, e) for e in errors]
        write_jsonl_atomic(self.rejected_path, lines)
        return lines

    def tally(self) -> Tally:
        t = Tally()
        for line in read_jsonl(self.rejected_path) + read_jsonl(self.collected_path):
            t.add(line)
        return t

    def split(self, custom_ids: list[str], missing_code: str, missing_message: str
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Tally]:
        """(output lines, error lines, their tally). Submitted requests with no collected line (the batch
        ended before they were submitted or collected) become error lines with `missing_code`."""
        rejected = read_jsonl(self.rejected_path)
        collected = read_jsonl(self.collected_path)
        seen = {line.get("custom_id") for line in collected}
        missing = [unfinished_line(self.batch_id, cid, missing_code, missing_message)
                   for cid in custom_ids if cid not in seen]
        ok, bad, tally = [], [], Tally()
        for line in rejected + collected + missing:
            (ok if succeeded(line) else bad).append(client_line(line))
            tally.add(line)
        return ok, bad, tally

    def remove(self) -> None:
        for p in (self.rejected_path, self.collected_path):
            p.unlink(missing_ok=True)
        try:
            self.root.rmdir()
        except OSError:
            pass  # not empty (a stray temp file): harmless


def jsonl_bytes(lines: list[dict[str, Any]]) -> bytes:
    return "".join(dump_line(line) + "\n" for line in lines).encode("utf-8")

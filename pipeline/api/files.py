"""FileStore: file bytes on disk under <data dir>/files, metadata in Redis (jobs.keys.api_file_key).

Every write goes to <data dir>/tmp first, is fsynced, then renamed into place (and the directory
fsynced), so a file is either whole or absent after a crash; its metadata is written only after the
rename, so metadata never names a missing file. Produced files (a batch's output and error files)
get ids derived from their batch, so finishing a batch again after a crash rewrites the same ids.
"""
from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from redis import Redis

from engine.files import atomic_write
from jobs import keys
from jobs.schemas import max_prompt_bytes
from pipeline.api.config import ServeConfig
from pipeline.api.errors import APIError, not_found
from pipeline.api.records import from_hash, page_ids, to_hash
from pipeline.api.schemas import FileRecord
from pipeline.batch_file import LINE_ENVELOPE_BYTES

_COPY_CHUNK = 1 << 20


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


def derived_file_id(*parts: str) -> str:
    return "file-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


class _LineCounter:
    """Non-empty lines in a byte stream fed in chunks (a line may span chunks)."""

    def __init__(self) -> None:
        self.count = 0
        self._open_line_has_text = False

    def feed(self, chunk: bytes) -> None:
        *complete, rest = chunk.split(b"\n")
        for part in complete:
            if self._open_line_has_text or part.strip():
                self.count += 1
            self._open_line_has_text = False
        self._open_line_has_text = self._open_line_has_text or bool(rest.strip())

    def total(self) -> int:
        return self.count + self._open_line_has_text


class _JsonlCheck:
    """Whether an upload is JSONL at all: no NUL byte (binary data, or UTF-16 text) and at least one line
    that is a JSON object. Single bad lines are the batch's to report by their numbers (pipeline.batch_file.
    parse_lines); a file with no request in it (an image, a CSV) is refused at upload, as OpenAI refuses it.
    Lines are parsed only until the first object is found."""

    def __init__(self, line_limit: int):
        self.line_limit = line_limit
        self.binary = False
        self.found = False
        self._line = bytearray()
        self._too_long = False

    def feed(self, chunk: bytes) -> None:
        self.binary = self.binary or b"\0" in chunk
        if self.found or self.binary:
            return
        *complete, rest = chunk.split(b"\n")
        for part in complete:
            self._end_line(part)
            if self.found:
                return
        self._add(rest)

    def _add(self, part: bytes) -> None:
        if not self._too_long:
            self._too_long = len(self._line) + len(part) > self.line_limit
            self._line += b"" if self._too_long else part

    def _end_line(self, part: bytes) -> None:
        self._add(part)
        if not self._too_long and self._line.strip():
            try:
                self.found = isinstance(json.loads(bytes(self._line)), dict)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep: a bad line
                pass
        self._line.clear()
        self._too_long = False

    def problem(self) -> str | None:
        """Why the whole file is not JSONL, after the last chunk; None when it is."""
        if not self.found and not self.binary:
            self._end_line(b"")  # a last line without a newline
        if self.binary:
            return "it holds NUL bytes (binary data, or UTF-16 text rather than UTF-8)"
        if not self.found:
            return "no line of it is a JSON object"
        return None


class FileStore:
    def __init__(self, connection: Redis, config: ServeConfig):
        self.connection = connection
        self.config = config

    def path(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise not_found("file", file_id)
        return self.config.files_dir / file_id

    # ------------------------------------------------------------ write
    def _write_atomic(self, file_id: str, chunks: Iterable[bytes], *, max_bytes: int | None = None,
                      jsonl: bool = False) -> tuple[int, int]:
        """Write chunks to the file's final path atomically; returns (bytes, non-empty lines). With
        `jsonl`, a file that is not JSONL at all is refused (400) and not kept."""
        self.config.make_dirs()
        size = 0
        lines = _LineCounter()
        check = _JsonlCheck(max_prompt_bytes() + LINE_ENVELOPE_BYTES) if jsonl else None
        with atomic_write(self.path(file_id), tmp_dir=self.config.tmp_dir, durable=True) as out:
            for chunk in chunks:
                size += len(chunk)
                if max_bytes is not None and size > max_bytes:
                    raise APIError(413, f"file is over the limit of {max_bytes:,} bytes", param="file",
                                   code="file_too_large")
                lines.feed(chunk)
                if check is not None:
                    check.feed(chunk)
                out.write(chunk)
            why = check.problem() if check is not None else None
            if why is not None:
                raise APIError(400, f"Invalid file format for Batch API. Must be .jsonl (one JSON request "
                                    f"object per line): {why}", param="file", code="invalid_file_format")
        return size, lines.total()

    def _register(self, record: FileRecord) -> FileRecord:
        with self.connection.pipeline(transaction=True) as p:
            p.hset(keys.api_file_key(record.id), mapping=to_hash(record.model_dump()))
            # ordered to the microsecond: files made within one second still list newest first
            p.zadd(keys.api_files_index_key(record.owner), {record.id: time.time()}, nx=True)
            p.execute()
        return record

    def save_upload(self, stream: IO[bytes], *, filename: str, purpose: str, owner: str) -> FileRecord:
        """Copy an uploaded file in (blocking: run in a thread). 413 over the size limit, 400 over the
        request limit."""
        file_id = new_file_id()

        def chunks() -> Iterable[bytes]:
            while chunk := stream.read(_COPY_CHUNK):
                yield chunk

        size, lines = self._write_atomic(file_id, chunks(), max_bytes=self.config.max_file_bytes,
                                         jsonl=purpose == "batch")
        if purpose == "batch" and lines > self.config.max_file_requests:
            self.path(file_id).unlink(missing_ok=True)
            raise APIError(400, f"the file has {lines:,} requests, over the limit of "
                                f"{self.config.max_file_requests:,} per batch file", param="file",
                           code="too_many_requests")
        return self._register(FileRecord(id=file_id, bytes=size, created_at=int(time.time()), filename=filename,
                                         purpose=purpose, owner=owner, requests=lines))

    def put_bytes(self, file_id: str, data: bytes, *, filename: str, purpose: str, owner: str) -> FileRecord:
        """A file the server produces (idempotent for a given id)."""
        size, lines = self._write_atomic(file_id, [data])
        return self._register(FileRecord(id=file_id, bytes=size, created_at=int(time.time()), filename=filename,
                                         purpose=purpose, owner=owner, requests=lines))

    # ------------------------------------------------------------ read
    def get(self, file_id: str) -> FileRecord | None:
        raw = self.connection.hgetall(keys.api_file_key(file_id))
        return FileRecord.model_validate(from_hash(raw)) if raw else None

    def get_owned(self, file_id: str, owner: str, *, param: str | None = None) -> FileRecord:
        """The file, or 404 when it does not exist or belongs to another key (the same answer: no hint)."""
        record = self.get(file_id)
        if record is None or record.owner != owner:
            raise not_found("file", file_id, param=param)
        return record

    def list(self, owner: str, *, purpose: str | None, after: str | None, limit: int,
             newest_first: bool) -> tuple[list[FileRecord], bool]:
        index = keys.api_files_index_key(owner)
        out: list[FileRecord] = []
        cursor = after
        while True:
            ids, more = page_ids(self.connection, index, after=cursor, limit=limit, newest_first=newest_first)
            for fid in ids:
                record = self.get(fid)
                if record is None:
                    self.connection.zrem(index, fid)
                elif purpose is None or record.purpose == purpose:
                    out.append(record)
                    if len(out) == limit:
                        return out, more or fid != ids[-1]
            if not more or not ids:
                return out, False
            cursor = ids[-1]

    # ------------------------------------------------------------ delete
    def delete(self, record: FileRecord) -> None:
        with self.connection.pipeline(transaction=True) as p:
            p.delete(keys.api_file_key(record.id))
            p.zrem(keys.api_files_index_key(record.owner), record.id)
            p.execute()
        self.path(record.id).unlink(missing_ok=True)

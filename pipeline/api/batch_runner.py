"""One thread per active API batch: validate and submit, collect, finalize. Resumable at every step.

    validating   parse the input file (bad lines -> rejected.jsonl with their line numbers), submit the
                 good ones as an rqllm batch with the same id (Client.submit_batch), -> in_progress
    in_progress  pipeline.collector.Collector writes collected.jsonl (its own checkpoint); the runner
                 counts each line into the batch's request_counts and usage
    cancelling   the batch's queued jobs are cancelled and its running ones stopped, unless another
                 batch or request waits for them (pipeline.cancel); the collector goes on until every
                 job has ended, so finished lines are kept
    finalizing   output and error files from the working files (ids derived from the batch id, so a
                 crash here makes the same files again) -> completed / cancelled / expired

A restarted server starts a runner for every batch in the active set (jobs.keys.API_ACTIVE_BATCHES);
each step checks the state it left in Redis and on disk, so nothing is submitted or written twice.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from jobs import keys
from pipeline.api.batch_output import BatchWorkDir, Tally, jsonl_bytes, rejected_line, write_jsonl_atomic
from pipeline.api.batches import BatchStore
from pipeline.api.config import ServeConfig
from pipeline.api.files import FileStore, derived_file_id
from pipeline.api.schemas import BatchErrorItem, BatchErrors, BatchRecord
from pipeline.batch_file import DUPLICATE_CUSTOM_ID, LineError, Refused, read_batch_file
from pipeline.cancel import cancel_unwanted_job
from pipeline.client import Client
from pipeline.model_check import ModelCheck
from pipeline.collector import Collector
from jobs.redis_conn import REDIS_DOWN_ERRORS, wait_for_redis

log = logging.getLogger("rqllm.api.batches")

MAX_LISTED_ERRORS = 1000  # in the batch object; the error file holds every one
RUNNER_ATTEMPTS = 5
_ENDINGS = {
    "cancelled": ("batch_cancelled", "the batch was cancelled before this request finished"),
    "expired": ("batch_expired", "the batch expired (its completion window ended) before this request finished"),
    "completed": ("missing_result", "no result was recorded for this request"),
}


class StopRunner(Exception):
    """The server is shutting down: leave the batch where it is, a restart resumes it."""


@dataclass
class RunnerContext:
    client: Client
    batches: BatchStore
    files: FileStore
    config: ServeConfig


class BatchRunner:
    def __init__(self, ctx: RunnerContext, batch_id: str, stopping: threading.Event):
        self.ctx = ctx
        self.batch_id = batch_id
        self.stopping = stopping
        self.cancel_requested = threading.Event()
        self.work = BatchWorkDir(ctx.config.batches_dir / batch_id, batch_id)
        self._jobs_cancelled = False
        self._expires_at: int | None = None

    # ------------------------------------------------------------ thread body
    def run(self) -> None:
        attempt = 0
        while not self.stopping.is_set():
            try:
                self._run()
                return
            except StopRunner:
                return
            except REDIS_DOWN_ERRORS as e:  # an outage is not the batch's fault: wait it out, go on
                log.warning("batch %s: Redis unreachable (%s); waiting", self.batch_id, e)
                wait_for_redis(self.ctx.client.connection, stop=self.stopping.is_set)
            except Exception as e:  # noqa: BLE001 - retried, then the batch fails with the reason
                attempt += 1
                log.exception("batch %s: runner failed (attempt %d)", self.batch_id, attempt)
                if attempt == RUNNER_ATTEMPTS:
                    self._fail("internal_error", f"{type(e).__name__}: {e}")
                    return
                self.stopping.wait(min(30.0, 2.0 ** attempt))

    def _run(self) -> None:
        record = self.ctx.batches.get(self.batch_id)
        if record is None:
            self.ctx.client.connection.srem(keys.API_ACTIVE_BATCHES, self.batch_id)
            return
        self._expires_at = record.expires_at
        if record.status == "validating":
            self._validate_and_submit(record)
            record = self._reload()
        if record.status in ("in_progress", "cancelling"):
            self._collect(record)
            record = self._reload()
        if record.status in ("in_progress", "cancelling", "finalizing"):
            self._finalize(record)

    def _reload(self) -> BatchRecord:
        record = self.ctx.batches.get(self.batch_id)
        if record is None:
            raise StopRunner()
        return record

    def _fail(self, code: str, message: str, line_errors: list[BatchErrorItem] | None = None) -> None:
        errors = line_errors or []
        errors.append(BatchErrorItem(code=code, message=message))
        self.ctx.batches.end(self.batch_id, "failed", errors=BatchErrors(data=errors).model_dump())
        self.work.remove()

    # ------------------------------------------------------------ validating
    def _validate_and_submit(self, record: BatchRecord) -> None:
        batches, client = self.ctx.batches, self.ctx.client
        path = self.ctx.files.path(record.input_file_id)
        if not path.exists():
            self._fail("invalid_file", f"input file {record.input_file_id} no longer exists")
            return
        # a line naming a model that no live worker holds and the registry does not know fails alone
        # (model_not_found), instead of waiting on a queue nobody serves for the whole window
        jobs, errors = read_batch_file(path, default_model=self.ctx.config.default_model, endpoint=record.endpoint,
                                       check_model=ModelCheck.live(client))
        self._write_rejected(errors)
        listed = [BatchErrorItem(code=e.code, message=e.message, param=e.param, line=e.lineno)
                  for e in errors[:MAX_LISTED_ERRORS]]
        duplicates = [e for e in errors if e.code == DUPLICATE_CUSTOM_ID]
        batches.set_counts(self.batch_id, total=len(jobs) + len(errors),
                           failed=len(jobs) + len(errors) if duplicates else len(errors), completed=0,
                           input_tokens=0, output_tokens=0)
        if listed:
            batches.update(self.batch_id, errors=BatchErrors(data=listed).model_dump())
        if duplicates:  # custom_id is the only key of an output line: the file is refused, nothing runs
            first = duplicates[0]
            self._fail(DUPLICATE_CUSTOM_ID, f"custom_id values must be unique in the input file: line {first.lineno}: "
                                            f"{first.message}" + (f" (and {len(duplicates) - 1} more)"
                                                                  if len(duplicates) > 1 else ""), listed)
            return
        if not jobs:
            self._fail("empty_batch" if not errors else "invalid_file",
                       "the input file holds no valid request" if errors else "the input file holds no request",
                       listed)
            return
        if batches.field(self.batch_id, "status") != "validating":
            return  # cancelled meanwhile: nothing is submitted
        if not client.connection.exists(keys.batch_key(self.batch_id)):
            # the refused lines go with it, so `rqllm status` and `rqllm collect` count them as this API does
            client.submit_batch(jobs, batch_id=self.batch_id, timeout=self.ctx.config.job_timeout,
                                retries=self.ctx.config.batch_retries, owner=record.owner,
                                metadata={"api": True, "input_file_id": record.input_file_id,
                                          "endpoint": record.endpoint},
                                refused=[Refused.from_line_error(e) for e in errors])
        batches.transition(self.batch_id, ("validating",), "in_progress")

    def _write_rejected(self, errors: list[LineError]) -> None:
        """rejected.jsonl: an error line per refused input line, with its LineError's code."""
        lines = []
        for e in errors:
            line = rejected_line(self.batch_id, e)
            line["error"]["code"] = e.code
            lines.append(line)
        write_jsonl_atomic(self.work.rejected_path, lines)

    # ------------------------------------------------------------ in progress
    def _collect(self, record: BatchRecord) -> None:
        if not self.ctx.client.connection.exists(keys.batch_key(self.batch_id)):
            return  # cancelled before it was submitted: finalizing accounts for every line
        tally = self.work.tally()  # lines written by an earlier run of this server
        self.ctx.batches.set_counts(self.batch_id, **tally.as_counts())
        if record.status == "cancelling":
            self.cancel_requested.set()
        self._tick()
        collector = Collector(self.ctx.client, self.batch_id, self.work.collected_path, progress=False,
                              on_line=self._on_line, health=self._tick, refused=False)  # ours: rejected.jsonl
        collector.run()

    def _on_line(self, line: dict) -> None:
        self.ctx.batches.add_counts(self.batch_id, **Tally().add(line).as_counts())
        self._tick()

    def _tick(self) -> None:
        """Between lines and when idle: shutdown, cancel, expiry."""
        if self.stopping.is_set():
            raise StopRunner()
        if self._jobs_cancelled:
            return
        if self.cancel_requested.is_set():
            self._cancel_jobs("cancelled")
        elif self._expires_at is not None and time.time() >= self._expires_at:
            self.ctx.batches.update(self.batch_id, end_as="expired")
            self._cancel_jobs("expired")

    def _cancel_jobs(self, ending: str) -> None:
        code, message = _ENDINGS[ending]
        client = self.ctx.client
        ids = sorted({jid for _, jid in client.batch_entries(self.batch_id)})
        done = client.results_for(ids)
        outcomes: dict[str, int] = {}
        for jid in ids:
            if jid not in done:
                what = cancel_unwanted_job(client.connection, jid, batch_id=self.batch_id, code=code, message=message,
                                           result_ttl=client.options.result_ttl, stream_ttl=client.options.stream_ttl)
                outcomes[what] = outcomes.get(what, 0) + 1
        self._jobs_cancelled = True
        log.info("batch %s %s: jobs %s", self.batch_id, ending, outcomes or "all ended already")

    # ------------------------------------------------------------ finalizing
    def _ending(self, record: BatchRecord) -> str:
        if record.status == "cancelling":
            return "cancelled"
        return self.ctx.batches.field(self.batch_id, "end_as") or "completed"

    def _custom_ids(self, record: BatchRecord) -> list[str]:
        client = self.ctx.client
        if client.connection.exists(keys.batch_entries_key(self.batch_id)):
            return [cid for cid, _ in client.batch_entries(self.batch_id)]
        path = self.ctx.files.path(record.input_file_id)  # never submitted (cancelled while validating)
        if not path.exists():
            return []
        jobs, _ = read_batch_file(path, default_model=self.ctx.config.default_model, endpoint=record.endpoint)
        return [j.custom_id for j in jobs if j.custom_id]

    def _finalize(self, record: BatchRecord) -> None:
        batches, files = self.ctx.batches, self.ctx.files
        ending = self._ending(record)
        batches.update(self.batch_id, end_as=ending)
        batches.transition(self.batch_id, ("in_progress", "cancelling"), "finalizing")
        code, message = _ENDINGS[ending]
        ok, bad, tally = self.work.split(self._custom_ids(record), code, message)
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for field_name, kind, lines in (("output_file_id", "output", ok), ("error_file_id", "error", bad)):
            if lines:
                file_id = derived_file_id(self.batch_id, kind)
                files.put_bytes(file_id, jsonl_bytes(lines), filename=f"{self.batch_id}_{kind}.jsonl",
                                purpose="batch_output", owner=record.owner)
                ids[field_name] = file_id
        batches.set_counts(self.batch_id, total=len(ok) + len(bad), **tally.as_counts())
        batches.end(self.batch_id, ending, **ids)
        self.work.remove()
        log.info("batch %s %s: %d completed, %d failed", self.batch_id, ending, tally.completed, tally.failed)


class BatchSupervisor:
    """The runner threads of this server process."""

    def __init__(self, ctx: RunnerContext):
        self.ctx = ctx
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._runners: dict[str, tuple[BatchRunner, threading.Thread]] = {}

    def start(self, batch_id: str) -> BatchRunner:
        with self._lock:
            current = self._runners.get(batch_id)
            if current is not None and current[1].is_alive():
                return current[0]
            runner = BatchRunner(self.ctx, batch_id, self.stopping)
            thread = threading.Thread(target=runner.run, name=f"batch-{batch_id}", daemon=True)
            self._runners[batch_id] = (runner, thread)
            thread.start()
            return runner

    def resume_all(self) -> int:
        ids = self.ctx.batches.active_ids(self.ctx.config.home_id())
        for batch_id in ids:
            self.start(batch_id)
        return len(ids)

    def cancel(self, batch_id: str) -> None:
        with self._lock:
            current = self._runners.get(batch_id)
            alive = current is not None and current[1].is_alive()
            if alive:
                current[0].cancel_requested.set()
        if not alive:
            self.start(batch_id).cancel_requested.set()

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [t for _, t in self._runners.values()]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

"""Collector: follow a batch until every job has ended, writing OpenAI Batch output lines as they end.

Resume: the output file is the checkpoint. On start the collector reads the custom_ids already in it
(a torn last line from a crash is cut off), writes every already-ended job it has not written (from
the stored results, so nothing depends on the events stream still holding old entries), then follows
the batch's events stream. Each line is written whole and flushed, so a restart never writes a
custom_id twice and never misses one. The lines refused at submission (Client.submit_batch's `refused`)
come first, as error lines with their custom_id, as the API's error file has them.

Following (events, reconciliation of jobs that can no longer end, the dead-worker reaper, Redis
outages): pipeline.batch_events, shared with the summariser.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from jobs.schemas import JobResult
from pipeline.batch_events import BatchFollower
from pipeline.batch_file import refused_output_line
from pipeline.openai_format import dump_line, output_line
from pipeline.batch_view import refused_lines
from pipeline.client import Client


@dataclass
class CollectSummary:
    batch_id: str
    requests: int  # every input line, refused ones included (the API's request_counts.total)
    written: int  # lines written by this run
    already: int  # lines found in the output file from an earlier run
    done: int
    failed: int  # refused ones included
    generated_tokens: int
    seconds: float
    skipped_events: int = 0
    refused: int = 0  # lines refused at submission (error lines, written first)

    @property
    def complete(self) -> bool:
        return self.written + self.already >= self.requests


def read_written(path: Path) -> set[str]:
    """custom_ids already in an output file; a torn trailing line is truncated away."""
    return {cid for _, cid in read_written_lines(path) if isinstance(cid, str)}


def read_written_lines(path: Path) -> list[tuple[str | None, str | None]]:
    """(id, custom_id) of each line already in an output file; a torn trailing line is truncated away."""
    if not path.exists():
        return []
    done: list[tuple[str | None, str | None]] = []
    good_end = 0
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl == -1:
            break  # no newline: torn write
        line = data[pos:nl]
        if line.strip():
            try:
                obj = json.loads(line)
                cid, rid = obj.get("custom_id"), obj.get("id")
            except (ValueError, AttributeError):
                break  # garbage: treat the rest as torn
            done.append((rid if isinstance(rid, str) else None, cid if isinstance(cid, str) else None))
        pos = nl + 1
        good_end = pos
    if good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


class _Progress:
    def __init__(self, total: int, initial: int, enabled: bool, desc: str):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, desc=desc, unit="req", file=sys.stderr,
                                dynamic_ncols=True, smoothing=0.1)
            except ImportError:
                self.bar = None

    def update(self, n: int, done: int, failed: int, total: int, tps: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"done={done} failed={failed} total={total} {tps:.1f} tok/s", refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class Collector:
    client: Client
    batch_id: str
    output: str | Path  # "-" for stdout (no resume)
    progress: bool = True
    block_ms: int = 1000
    reconcile_after: float = 10.0
    health: Callable[[], None] | None = None
    on_line: Callable[[dict[str, Any]], None] | None = None
    reap: bool = True  # also run the dead-worker reaper on the batch's queues
    reaper: Any = None  # a pipeline.recovery.Reaper to use (default: one for the batch's models)
    refused: bool = True  # write the lines refused at submission (the API keeps its own: False)
    _job_cids: dict[str, list[str]] = field(default_factory=dict, init=False)

    def run(self, timeout: float | None = None) -> CollectSummary:
        t0 = time.monotonic()
        status = self.client.batch_status(self.batch_id)
        entries = self.client.batch_entries(self.batch_id)
        for cid, jid in entries:
            self._job_cids.setdefault(jid, []).append(cid)
        to_stdout = str(self.output) == "-"
        refused = [refused_output_line(self.batch_id, i, r)
                   for i, r in enumerate(refused_lines(self.client.connection, self.batch_id) if self.refused else [])]
        refused_ids = {line["id"] for line in refused}
        written = [] if to_stdout else read_written_lines(Path(self.output))
        # a refused line may carry a custom_id a submitted line has too (a duplicate): keyed by its id
        written_cids = {cid for rid, cid in written if rid not in refused_ids} & {cid for cid, _ in entries}
        refused_todo = [line for line in refused if line["id"] not in {rid for rid, _ in written}]
        already = len(written_cids) + len(refused) - len(refused_todo)
        pending: dict[str, list[str]] = {}
        ended: set[str] = set()
        for jid, cids in self._job_cids.items():
            rest = [c for c in cids if c not in written_cids]
            if rest:
                pending[jid] = rest
            else:
                ended.add(jid)

        out: IO[str]
        out = sys.stdout if to_stdout else open(self.output, "a", encoding="utf-8")
        counts = {"done": 0, "failed": len(refused_todo), "tokens": 0, "written": len(refused_todo)}
        bar = _Progress(len(entries) + len(refused), already, self.progress, self.batch_id)
        last_fsync = time.monotonic()
        gen_since = status.created
        for line in refused_todo:  # first: they are known now
            out.write(dump_line(line) + "\n")
            if self.on_line is not None:
                self.on_line(line)
        out.flush()
        bar.update(len(refused_todo), 0, len(refused_todo), len(entries) + len(refused), 0.0)

        def write(jid: str, result: JobResult | None) -> None:
            nonlocal last_fsync
            cids = pending.pop(jid, None)
            if not cids:
                return
            ended.add(jid)
            for cid in cids:
                line = output_line(self.batch_id, cid, result, job_id=jid)
                out.write(dump_line(line) + "\n")
                if self.on_line is not None:
                    self.on_line(line)
            out.flush()
            ok = result is not None and result.status == "done"
            counts["done" if ok else "failed"] += len(cids)
            counts["written"] += len(cids)
            if ok and result.ended_at >= gen_since:
                counts["tokens"] += result.completion_tokens
            if not to_stdout and time.monotonic() - last_fsync > 1.0:
                os.fsync(out.fileno())
                last_fsync = time.monotonic()
            elapsed = max(1e-6, time.time() - gen_since)
            bar.update(len(cids), counts["done"], counts["failed"], len(entries) + len(refused),
                       counts["tokens"] / elapsed)

        follower = BatchFollower(self.client, self.batch_id, block_ms=self.block_ms,
                                 reconcile_after=self.reconcile_after, health=self.health, reaper=self.reaper,
                                 reap=self.reap)
        try:
            follower.follow(list(pending), write, timeout=timeout, models=status.models)
        finally:
            bar.close()
            if not to_stdout:
                out.flush()
                os.fsync(out.fileno())
                out.close()
        return CollectSummary(
            batch_id=self.batch_id, requests=len(entries) + len(refused), written=counts["written"], already=already,
            done=counts["done"], failed=counts["failed"], generated_tokens=counts["tokens"],
            seconds=time.monotonic() - t0, skipped_events=follower.skipped_events, refused=len(refused),
        )


def collect(client: Client, batch_id: str, output: str | Path, **kwargs: Any) -> CollectSummary:
    timeout = kwargs.pop("timeout", None)
    return Collector(client, batch_id, output, **kwargs).run(timeout=timeout)

"""Following a batch until its jobs have ended: the one loop the collector and the summariser share.

The jobs' outcomes come from the batch's events stream (jobs.ledger appends one per job, atomically
with storing its result): each pending job that ends is handed to `on_end` with its stored JobResult
(None when the result expired meanwhile). Before the first event, outcomes already stored are handed
over (nothing depends on the events stream still holding old entries). When nothing happens for
`reconcile_after` seconds, jobs that can no longer end by themselves (their rq job deleted, canceled,
failed outside a worker) are recorded failed (Client.reconcile), so following never waits forever;
the dead-worker reaper (pipeline.recovery) runs on the batch's queues every few seconds, so a job
whose worker was killed is retried even when every other worker is busy. A Redis outage longer than
the connection's own retries is waited out, and following goes on from the last event seen.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from jobs.redis_conn import REDIS_DOWN_ERRORS, wait_for_redis
from jobs.schemas import JobResult, queue_names
from pipeline.client import Client


@dataclass
class BatchFollower:
    client: Client
    batch_id: str
    block_ms: int = 1000
    reconcile_after: float = 10.0
    health: Callable[[], None] | None = None  # called when a read found nothing (e.g. an embedded cluster's check)
    on_idle: Callable[[], None] | None = None  # called after reconcile_after seconds without an outcome
    reaper: Any = None  # a pipeline.recovery.Reaper; default: one for the batch's models (reap=True)
    reap: bool = True
    name: str = "collector"
    pending: dict[str, None] = field(default_factory=dict, init=False)  # insertion-ordered set
    skipped_events: int = field(default=0, init=False)

    def follow(self, job_ids: Iterable[str], on_end: Callable[[str, JobResult | None], None], *,
               timeout: float | None = None, models: Iterable[str] = ()) -> None:
        """Hand every job of `job_ids` to on_end once, as it ends; returns when none is pending.
        models: the batch's models (their queues are reaped)."""
        t0 = time.monotonic()
        self.pending = dict.fromkeys(job_ids)
        reaper = self.reaper
        if reaper is None and self.reap:
            from pipeline.recovery import Reaper

            qnames = [q for m in models for q in queue_names(m)]
            reaper = Reaper(self.client.connection, qnames, name=f"{self.name} {self.batch_id}")

        def end(jid: str, result: JobResult | None) -> None:
            if jid in self.pending:
                del self.pending[jid]
                on_end(jid, result)

        self._sweep(end)
        last_id = "0"
        last_progress = time.monotonic()
        while self.pending:
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise TimeoutError(f"batch {self.batch_id}: {len(self.pending)} job(s) still pending after {timeout} s")
            if reaper is not None:
                reaper.maybe_run()
            try:
                last_id, progressed = self._step(last_id, end, last_progress)
            except REDIS_DOWN_ERRORS as e:
                # Longer than the connection's own retries: wait it out (the timeout still applies).
                # last_id only moves after an event's jobs are handed over, so nothing is skipped.
                print(f"{self.name} {self.batch_id}: Redis unreachable ({e}); waiting", file=sys.stderr)
                wait_for_redis(self.client.connection,
                               stop=lambda: timeout is not None and time.monotonic() - t0 > timeout)
                continue
            if progressed:
                last_progress = time.monotonic()

    def _sweep(self, end: Callable[[str, JobResult | None], None]) -> None:
        ids = list(self.pending)
        found = self.client.results_for(ids)
        for jid in ids:
            if jid in found:
                end(jid, found[jid])

    def _step(self, last_id: str, end: Callable[[str, JobResult | None], None],
              last_progress: float) -> tuple[str, bool]:
        """One round: read events (blocking up to block_ms) and hand over their jobs, or reconcile when
        idle. Returns the new last event id and whether to reset the idle clock."""
        events = self.client.events(self.batch_id, last_id, block_ms=self.block_ms)
        if events:
            ids = [str(e.data["job"]) for e in events if "job" in e.data and str(e.data["job"]) in self.pending]
            if ids:
                found = self.client.results_for(ids)
                for jid in ids:
                    # The result is stored atomically with the event; missing = expired meanwhile.
                    end(jid, found.get(jid))
            self.skipped_events += len(events) - len(ids)
            return events[-1].id, bool(ids)
        if self.health is not None:
            self.health()
        if time.monotonic() - last_progress >= self.reconcile_after:
            if self.on_idle is not None:
                self.on_idle()
            if self.client.reconcile(self.batch_id, list(self.pending), grace=1.0) == 0:
                self._sweep(end)  # covers an events stream that expired or was trimmed
            return last_id, True
        return last_id, False

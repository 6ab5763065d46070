"""The heartbeat of the job a worker is running: one long-lived thread, beating while a job is in progress."""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from rq.job import Job

if TYPE_CHECKING:
    from pipeline.worker import LLMWorker

log = logging.getLogger("rqllm.worker")


class JobHeartbeat(threading.Thread):
    """One long-lived thread that beats for the job in progress (no thread start/join per job)."""

    def __init__(self, worker: LLMWorker, interval: float):
        super().__init__(name="rqllm-heartbeat", daemon=True)
        self.worker, self.interval = worker, interval
        self._lock = threading.Lock()
        self._current: tuple[Job, Any] | None = None
        self._halt = threading.Event()
        self.beats = 0

    def begin(self, job: Job, execution: Any) -> None:
        with self._lock:
            self._current = (job, execution)

    def end(self) -> None:
        with self._lock:
            self._current = None

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            with self._lock:
                current = self._current
            if current is None:
                continue
            try:
                # xx-only updates: a beat racing the job's end cannot re-register it
                self.worker.maintain_heartbeats(*current)
                self.beats += 1
            except Exception:  # noqa: BLE001 - a missed beat is retried next interval
                log.warning("heartbeat for job %s failed", current[0].id, exc_info=True)
            # A busy worker reaps too, so a dead worker's job is found even when no worker is idle.
            self.worker.reaper.maybe_run()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

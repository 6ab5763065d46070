"""Drop to one engine thread while the cores are shared, and come back when they are free again.

The kernels split every pass across their threads, which meet at barriers many times per token. When
another process holds one of the cores (more workers than cores, a busy host), the thread that got
preempted stalls its partner at the next barrier for the rest of a scheduler time slice: two
2-thread workers on 2 cores ran at a small fraction of what two 1-thread workers do. One thread has
no barriers and keeps its fair share.

The governor watches the process's CPU time against the wall time of the passes: a thread that
waits at a barrier sleeps (GOMP_SPINCOUNT, engine/kernels/__init__.py), so a starved process shows
as CPU time well under threads x wall time. Then it runs on one thread, and tries all of them again
after a while (waiting longer after each failed try). Results do not depend on the thread count, so
switching changes only speed. RQLLM_ADAPTIVE_THREADS=0 keeps every thread whatever happens.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WINDOW_S = 0.25  # passes are measured in windows of at least this much wall time
STARVED = 0.6  # CPU time below this share of threads x wall time: the cores are shared
RETRY_S = 5.0  # first retry of all threads after a drop; doubles after each failed retry
RETRY_MAX_S = 60.0


@dataclass
class ThreadGovernor:
    """Chooses the thread count before each pass (`threads`) and learns from its timing (`record`)."""

    max_threads: int
    enabled: bool = field(default_factory=lambda: os.environ.get("RQLLM_ADAPTIVE_THREADS", "1") != "0")
    wall_clock: Callable[[], float] = time.perf_counter
    cpu_clock: Callable[[], float] = time.process_time
    threads: int = field(init=False)
    _wall: float = field(default=0.0, init=False)
    _cpu: float = field(default=0.0, init=False)
    _retry_at: float = field(default=0.0, init=False)
    _retry_wait: float = field(default=RETRY_S, init=False)

    def __post_init__(self) -> None:
        self.threads = max(1, self.max_threads)

    def run(self, fn: Callable[[int], None]) -> None:
        """fn(threads): one pass on the chosen thread count, timed."""
        if self.max_threads <= 1 or not self.enabled:
            fn(self.max_threads)
            return
        if self.threads == 1 and self.wall_clock() >= self._retry_at:
            self.threads = self.max_threads  # a retry: measured like any window
            self._reset()
        w0, c0 = self.wall_clock(), self.cpu_clock()
        fn(self.threads)
        self.record(self.wall_clock() - w0, self.cpu_clock() - c0)

    def record(self, wall: float, cpu: float) -> None:
        self._wall += wall
        self._cpu += cpu
        if self._wall < WINDOW_S:
            return
        share = self._cpu / (self._wall * self.threads)
        if self.threads > 1 and share < STARVED:
            log.info("engine: %d threads got %.0f%% of their CPU time (the cores are shared): running on 1 "
                     "thread, trying %d again in %.0f s", self.threads, 100 * share, self.max_threads,
                     self._retry_wait)
            self.threads = 1
            self._retry_at = self.wall_clock() + self._retry_wait
            self._retry_wait = min(2 * self._retry_wait, RETRY_MAX_S)
        elif self.threads > 1:
            self._retry_wait = RETRY_S  # all threads ran well: the next drop starts over
        self._reset()

    def _reset(self) -> None:
        self._wall = self._cpu = 0.0

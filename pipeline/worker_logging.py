"""A worker's log lines: rq's handlers for its own, the repack progress, the engine's and the jobs' lines, with
rq's routine per-job and per-maintenance lines at DEBUG."""
from __future__ import annotations

import logging

from rq.logutils import setup_loghandlers

from pipeline.job_engine import log_repack


class RoutineLinesToDebug(logging.Filter):
    """rq's INFO lines for every job ("Successfully completed...", "Job OK", "result is kept...") and for
    every maintenance pass ("cleaning ... registries", each minute) at DEBUG: at INFO a worker logs one line
    per job, jobs.runtime's, with its tokens and speeds."""

    ROUTINE = ("Successfully completed ", "Worker %s: %s: %s (%s)", "Worker %s: job %s result ",
               "Worker %s: cleaning ")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and isinstance(record.msg, str) and record.msg.startswith(self.ROUTINE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def setup_worker_logging(level: str) -> None:
    """rq's handlers (time-stamped lines; errors to stderr) for rq's worker log, the repack progress and the
    jobs' lines (jobs.runtime), with rq's routine lines at DEBUG. rq installs its handlers only when
    work() starts: without this the start-up line was dropped."""
    logging.getLogger("rqllm").setLevel(level)
    # rqllm.engine: the engine's own lines (speculative decoding's timed pass costs, a matcher's error)
    for name in ("rq.worker", log_repack.name, "rqllm.tasks", "rqllm.engine"):
        setup_loghandlers(level, name=name)
    rq_log = logging.getLogger("rq.worker")
    if not any(isinstance(f, RoutineLinesToDebug) for f in rq_log.filters):
        rq_log.addFilter(RoutineLinesToDebug())

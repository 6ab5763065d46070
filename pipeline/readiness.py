"""A worker's readiness: ready once its model is loaded and it takes jobs; not ready while Redis is away,
and once it exits.

It says so with a file (--ready-file / RQLLM_READY_FILE: it exists only while the worker is ready, so
`test -f FILE` is a compose healthcheck and a Kubernetes exec readiness probe), and, with --metrics-port,
the rqllm_worker_ready gauge and GET /ready (pipeline.worker_metrics).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path


class ReadyFile:
    """A file that exists only while the worker is ready. A stale one (a container restarted after a
    kill) is removed before the model loads."""

    def __init__(self, path: str | os.PathLike[str] | None):
        self.path = Path(path) if path else None
        self.set(False)

    def set(self, ready: bool) -> None:
        if self.path is None:
            return
        if ready:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(f"{os.getpid()}\n")
        else:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class Readiness:
    """The worker's ready signal, to every place it goes: the file, and `also` (the metrics' gauge)."""

    def __init__(self, ready_file: ReadyFile, also: Callable[[bool], None] | None = None):
        self.file = ready_file
        self.also = also

    def set(self, ready: bool) -> None:
        self.file.set(ready)
        if self.also is not None:
            self.also(ready)

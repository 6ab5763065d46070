"""Files on disk, for every layer: where rqllm's caches live, and writes that a reader or a crash never
sees half done (written under a temporary name, then renamed over the final one). Standard library only,
so that any module may use it."""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def cache_dir() -> Path:
    """Where models and every derived cache live: $RQLLM_CACHE, else ~/.cache/rqllm (XDG_CACHE_HOME honoured)."""
    if os.environ.get("RQLLM_CACHE"):
        return Path(os.environ["RQLLM_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rqllm"


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable. Best effort: some filesystems cannot open a directory to sync it,
    and the rename itself has happened either way."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path, *, tmp: Path | None = None, durable: bool = False) -> Iterator[Path]:
    """A temporary name for a file the caller writes (a writer that takes a path, or a mapping); when the
    block ends without an error it is renamed to `path`, else removed. tmp: that name (default: a fresh
    one beside `path`). durable: also sync the directory, so the rename survives a crash
    (the caller has synced the file's data)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "wb", *, tmp_dir: Path | None = None, durable: bool = False,
                 permissions: int | None = None) -> Iterator[IO[Any]]:
    """Open a temporary file for writing (mode "w" for text, UTF-8, or "wb"); when the block ends without
    an error it becomes `path` at once (a reader sees the old file or the whole new one), else it is removed.
    tmp_dir: where the temporary file lives (same filesystem as `path`; default: `path`'s directory; both are
    made if missing). durable: fsync the data and the directory, so a crash leaves the whole file or none.
    permissions: the file's mode (mkstemp makes it 0600; a cache other users' processes read wants 0644)."""
    directory = tmp_dir or path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    with atomic_path(path, tmp=Path(name), durable=durable) as tmp:
        with open(tmp, mode, **({"encoding": "utf-8"} if "b" not in mode else {})) as out:
            yield out
            if durable:
                out.flush()
                os.fsync(out.fileno())
        if permissions is not None:
            os.chmod(tmp, permissions)

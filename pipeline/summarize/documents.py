"""The inputs: files, folders and globs -> readable text documents, and every skipped path with why."""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BYTES = 4 * 1024 * 1024


@dataclass
class Document:
    path: str  # as shown to the user
    text: str
    size: int


@dataclass
class Skipped:
    path: str
    reason: str


_GLOB_CHARS = re.compile(r"[*?\[]")


def collect_documents(paths: Iterable[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[list[Document], list[Skipped]]:
    """Files, folders (recursively, hidden entries left out) and globs -> readable text documents.

    Everything else is reported, never silently dropped: missing paths, unreadable files, empty
    files, binary or non-UTF-8 files, and files over `max_bytes`.
    """
    files: list[Path] = []
    skipped: list[Skipped] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            files.extend(_walk(p))
        elif p.exists() or p.is_symlink():
            files.append(p)
        elif _GLOB_CHARS.search(raw):
            matches = sorted(glob.glob(os.path.expanduser(raw), recursive=True))
            if not matches:
                skipped.append(Skipped(raw, "no file matches this pattern"))
            for m in matches:
                mp = Path(m)
                files.extend(_walk(mp) if mp.is_dir() else [mp])
        else:
            skipped.append(Skipped(raw, "not found"))
    docs: list[Document] = []
    seen: set[str] = set()
    for f in files:
        try:
            key = str(f.resolve())
        except OSError:
            key = str(f.absolute())
        if key in seen:
            continue
        seen.add(key)
        doc_or_skip = read_document(f, max_bytes=max_bytes)
        (docs if isinstance(doc_or_skip, Document) else skipped).append(doc_or_skip)
    return docs, skipped


def _walk(folder: Path) -> list[Path]:
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out.extend(Path(root) / n for n in sorted(names) if not n.startswith("."))
    return out


def read_document(path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Document | Skipped:
    shown = str(path)
    try:
        st = path.stat()
    except OSError as e:
        return Skipped(shown, f"unreadable: {e.strerror or e}")
    if not path.is_file():
        return Skipped(shown, "not a regular file")
    if st.st_size > max_bytes:
        return Skipped(shown, f"too large: {st.st_size:,} bytes (limit {max_bytes:,}; see --max-bytes)")
    try:
        data = path.read_bytes()
    except OSError as e:
        return Skipped(shown, f"unreadable: {e.strerror or e}")
    if not data.strip():
        return Skipped(shown, "empty")
    if b"\x00" in data[:8192]:
        return Skipped(shown, "binary (contains NUL bytes)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return Skipped(shown, f"binary or not UTF-8 text (byte {e.start} is invalid)")
    control = sum(1 for ch in text[:8192] if ord(ch) < 32 and ch not in "\n\r\t\f\v\x1b")
    if control > max(8, len(text[:8192]) // 100):
        return Skipped(shown, "binary (many control characters)")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        return Skipped(shown, "empty")
    return Document(shown, text, len(data))

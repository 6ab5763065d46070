"""The inputs: files, folders and globs -> readable text documents, and every skipped path with why."""
from __future__ import annotations

import codecs
import glob
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
# A byte order mark says the encoding outright (UTF-32's marks begin with UTF-16's: they come first).
BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
        (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
WESTERN_ON_TIE = ("cp1252", "latin_1", "iso8859_15")
ENCODING_NOTES = {"utf-16": "read as UTF-16 (byte order mark)", "utf-32": "read as UTF-32 (byte order mark)"}


@dataclass
class Document:
    path: str  # as shown to the user
    text: str
    size: int
    encoding: str = "utf-8"  # how the bytes were read (Python's codec name); the report says it when not UTF-8

    @property
    def encoding_note(self) -> str | None:
        """How a file that is not plain UTF-8 was read, for the report; None for UTF-8."""
        return None if self.encoding in ("utf-8", "utf-8-sig") else ENCODING_NOTES.get(self.encoding, f"read as {self.encoding} "
                                                                      "(guessed by charset-normalizer)")


@dataclass
class Skipped:
    path: str
    reason: str


_GLOB_CHARS = re.compile(r"[*?\[]")


def collect_documents(paths: Iterable[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[list[Document], list[Skipped]]:
    """Files, folders (recursively, hidden entries left out) and globs -> readable text documents.

    Everything else is reported, never silently dropped: missing paths, unreadable files, empty
    files, binary files, and files over `max_bytes`. Text need not be UTF-8 (decode_text).
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
    decoded = decode_text(data)
    if isinstance(decoded, str):
        return Skipped(shown, decoded)
    text, encoding = decoded
    control = sum(1 for ch in text[:8192] if ord(ch) < 32 and ch not in "\n\r\t\f\v\x1b")
    if control > max(8, len(text[:8192]) // 100):
        return Skipped(shown, "binary (many control characters)")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        return Skipped(shown, "empty")
    return Document(shown, text, len(data), encoding)


def decode_text(data: bytes) -> tuple[str, str] | str:
    """(text, the codec it was read with), or why the bytes are not taken as text. A byte order mark
    decides (UTF-8, UTF-16, UTF-32); otherwise UTF-8 when the bytes are valid UTF-8, else the encoding
    charset-normalizer finds most plausible (Latin-1 / Windows-1252 and the like). NUL bytes without a
    mark mean binary."""
    for bom, codec in BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec), codec
            except UnicodeDecodeError as e:
                return f"not valid {codec.removesuffix('-sig').upper()} despite its byte order mark (byte {e.start})"
    if b"\x00" in data[:8192]:
        return "binary (contains NUL bytes)"
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError as e:
        utf8_error = e.start
    from charset_normalizer import from_bytes

    results = from_bytes(data)
    best = results.best()
    if best is None:
        return f"binary, or text in no encoding charset-normalizer recognises (not UTF-8: byte {utf8_error} is invalid)"
    # Single-byte code pages often decode the same text equally well (French in cp1250 and cp1252 alike,
    # differing only in a few letters): on a tie, the Western one, which is what Latin-1 files are.
    tied = [r for r in results if (r.chaos, r.coherence) == (best.chaos, best.coherence)]
    chosen = next((r for name in WESTERN_ON_TIE for r in tied if r.encoding == name), best)
    return str(chosen), chosen.encoding

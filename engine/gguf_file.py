"""A small, fast GGUF header reader over a read-only mmap.

Why not ``gguf.GGUFReader``: it builds a numpy object per metadata array
element in Python, which takes seconds on a 262k-entry vocabulary (3 s on
SmolLM2, 15 s on Gemma 3 here).  This reader only walks the length prefixes of
string arrays at open time (the format gives no other way to find the next
key; with ``index_cache`` the offsets are kept on disk and only verified next
time) and decodes them lazily on first access; numeric arrays are single
``np.frombuffer`` calls; tensor data is never copied.  Constants (value types,
ggml types, block sizes, magic) come from the ``gguf`` package.

Layout (GGUF v2/v3, little-endian):
    magic u32 | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: string, value_type u32, value)
    n_tensors x (name: string, n_dims u32, ne[n_dims] u64, type u32, offset u64)
    padding to `general.alignment` (default 32) | tensor data
    string = u64 length + UTF-8 bytes; array = item_type u32, count u64, items
"""

from __future__ import annotations

import codecs
import hashlib
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.gguf_constants import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType,
                                   GGUFValueType)

__all__ = ["GGUFError", "TensorInfo", "GGUFFile"]

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
HEADER_SIZE = 24
MAX_KEY_BYTES = 65535  # the GGUF spec: keys are at most 2^16 - 1 bytes
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 including the terminating NUL
_DECODE_CHUNK = 1 << 20
# String arrays at least this long get their item offsets kept in the index cache (see _walk_strings).
INDEX_MIN_ITEMS = 4096

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# value type -> (struct for scalars, numpy dtype for arrays)
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<?"), np.dtype("?")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}

_TYPE_NAMES = {int(t): t.name for t in GGUFValueType}


class GGUFError(ValueError):
    """Anything wrong with a GGUF file; the message names the file, what and where."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (the contiguous dimension) first
    type: int  # ggml type id (gguf.GGMLQuantizationType)
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.type).name


class _LazyStrings:
    """A string array found at open (item start offsets) and decoded on first access."""

    __slots__ = ("starts", "end", "key")

    def __init__(self, starts: np.ndarray, end: int, key: str):
        self.starts = starts  # int64: absolute offset of each item's bytes (its u64 length sits just before)
        self.end = end  # one past the last item's bytes
        self.key = key

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        st = np.asarray(self.starts, dtype=np.int64)
        en = np.empty_like(st)
        if len(st):
            en[:-1] = st[1:] - 8
            en[-1] = self.end
        return st, en


class _Metadata(Mapping):
    """Read-only mapping; string arrays materialise as list[str] when first read."""

    def __init__(self, owner: GGUFFile, raw: dict[str, Any]):
        self._owner = owner
        self._raw = raw

    def __getitem__(self, key: str) -> Any:
        v = self._raw[key]
        if isinstance(v, _LazyStrings):
            v = self._owner._decode_strings(v)
            self._raw[key] = v
        return v

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def value_type(self, key: str) -> tuple[int, int | None]:
        """(value type, array item type or None) as stored in the file."""
        return self._owner._types[key]


def _split_at_prefixes(buf: np.ndarray, st: np.ndarray, en: np.ndarray) -> list[str] | None:
    """A string array's items in C-speed passes, no Python work per item: each item's 8-byte length
    prefix is replaced by one NUL (dropping 7 of its bytes, zeroing the 8th), the region is decoded
    once and split at the NULs. buf is the region from the first prefix on; st/en are item bounds
    relative to it. None when that cannot be exact: an item holds a NUL itself (the count of pieces
    shows it) or the region is not valid UTF-8 (then each item is checked on its own to name the bad one).
    """
    prefixes = st[:, None] - np.arange(8, 0, -1)  # byte positions of each length prefix
    keep = np.ones(len(buf), dtype=bool)
    keep[prefixes[:, :7].ravel()] = False
    region = buf.copy()
    region[prefixes[:, 7]] = 0
    try:
        text = region[keep].tobytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    items = text.split("\x00")
    if len(items) != len(st) + 1 or int(en[-1]) != len(buf):
        return None
    return items[1:]  # the first piece is the empty text before item 0's prefix


class GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table over a read-only mmap."""

    def __init__(self, path: str | os.PathLike, *, index_cache: bool = False):
        """index_cache: keep the item offsets of long string arrays (the vocabulary, the merges) in
        the rqllm cache so the next open skips walking them (start-up time); off by default so
        one-off files (tests, fuzzing) leave nothing behind."""
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self._types: dict[str, tuple[int, int | None]] = {}
        self._index_key: str | None = None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            if index_cache:
                ident = hashlib.sha1(os.fsencode(os.path.realpath(self.path))).hexdigest()[:16]
                self._index_key = f"{ident}-{st.st_size}-{st.st_mtime_ns}"
            if self.size < HEADER_SIZE:
                raise GGUFError(
                    f"{self.path}: file is {self.size} bytes, shorter than a GGUF header ({HEADER_SIZE} bytes)"
                )
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot mmap: {e}") from e
        finally:
            os.close(fd)
        try:
            self._parse()
        except GGUFError:
            self.close()
            raise
        except (struct.error, IndexError, OverflowError, MemoryError, ValueError) as e:  # safety net
            self.close()
            raise GGUFError(f"{self.path}: malformed GGUF ({type(e).__name__}: {e})") from e

    # ------------------------------------------------------------------ parsing
    def _err(self, what: str, pos: int | None = None) -> GGUFError:
        where = f" at offset {pos}" if pos is not None else ""
        return GGUFError(f"{self.path}: {what}{where}")

    def _need(self, pos: int, n: int, what: str) -> None:
        if n < 0 or pos + n > self.size:
            raise self._err(
                f"{what} runs past the end of the file (needs {n} bytes, {max(self.size - pos, 0)} left)", pos
            )

    def _u32(self, pos: int, what: str) -> int:
        self._need(pos, 4, what)
        return _U32.unpack_from(self._mm, pos)[0]

    def _u64(self, pos: int, what: str) -> int:
        self._need(pos, 8, what)
        return _U64.unpack_from(self._mm, pos)[0]

    def _str(self, pos: int, what: str, max_len: int | None = None) -> tuple[str, int]:
        n = self._u64(pos, f"{what} length")
        if max_len is not None and n > max_len:
            # checked before slicing: a corrupt length must not make us copy and decode megabytes
            raise self._err(f"{what} is {n} bytes long (at most {max_len} allowed)", pos)
        self._need(pos + 8, n, f"{what} ({n} bytes)")
        try:
            with memoryview(self._mm) as view:
                data = view[pos + 8 : pos + 8 + n]
                if n <= _DECODE_CHUNK:
                    return str(data, "utf-8"), pos + 8 + n
                # Long strings in chunks: a corrupt length over a big file then costs only the bytes up
                # to the first invalid one (a one-shot decode allocates and copies all n bytes first).
                decoder = codecs.getincrementaldecoder("utf-8")()
                parts = [decoder.decode(data[i : i + _DECODE_CHUNK]) for i in range(0, n, _DECODE_CHUNK)]
                parts.append(decoder.decode(b"", final=True))
                return "".join(parts), pos + 8 + n
        except UnicodeDecodeError as e:
            raise self._err(f"{what} is not valid UTF-8 ({e.reason})", pos) from None

    def _parse(self) -> None:
        mm = self._mm
        magic = _U32.unpack_from(mm, 0)[0]
        if magic != GGUF_MAGIC:
            raise self._err(f"not a GGUF file: magic is {bytes(mm[0:4])!r}, expected b'GGUF'", 0)
        self.version = _U32.unpack_from(mm, 4)[0]
        if self.version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            hint = " (looks like a big-endian GGUF, which is not supported)" if swapped in SUPPORTED_VERSIONS else ""
            raise self._err(
                f"unsupported GGUF version {self.version}{hint}; supported: {', '.join(map(str, SUPPORTED_VERSIONS))}",
                4,
            )
        n_tensors, n_kv = _U64.unpack_from(mm, 8)[0], _U64.unpack_from(mm, 16)[0]
        remaining = self.size - HEADER_SIZE
        # smallest possible entries: kv = key len(8) + type(4) + 1-byte value; tensor = name len(8)+n_dims(4)+type(4)+offset(8)
        if n_kv * 13 > remaining:
            raise self._err(f"metadata count {n_kv} is absurd for a {self.size}-byte file", 16)
        if n_tensors * 24 > remaining:
            raise self._err(f"tensor count {n_tensors} is absurd for a {self.size}-byte file", 8)

        pos = HEADER_SIZE
        raw: dict[str, Any] = {}
        for i in range(n_kv):
            key, pos = self._str(pos, f"metadata key #{i}", MAX_KEY_BYTES)
            if key in raw:
                raise self._err(f"duplicate metadata key {key!r}", pos)
            vtype = self._u32(pos, f"value type of {key!r}")
            pos += 4
            raw[key], pos = self._value(vtype, pos, key)
        self._raw = raw
        self.metadata_end = pos  # where the tensor table starts
        self.metadata = _Metadata(self, raw)

        self.alignment = GGUF_DEFAULT_ALIGNMENT
        if "general.alignment" in raw:
            a = raw["general.alignment"]
            if self._types["general.alignment"][0] != GGUFValueType.UINT32 or a <= 0 or a & (a - 1):
                raise self._err(f"general.alignment must be a power-of-two uint32, got {a!r}")
            self.alignment = a

        entries = []
        names: set[str] = set()
        for i in range(n_tensors):
            start = pos
            name, pos = self._str(pos, f"name of tensor #{i}", MAX_NAME_BYTES)
            if name in names:
                raise self._err(f"duplicate tensor name {name!r}", start)
            names.add(name)
            n_dims = self._u32(pos, f"n_dims of tensor {name!r}")
            pos += 4
            if n_dims > MAX_DIMS:
                raise self._err(f"tensor {name!r} has {n_dims} dimensions (max {MAX_DIMS})", pos - 4)
            self._need(pos, 8 * n_dims + 12, f"tensor info of {name!r}")
            shape = struct.unpack_from(f"<{n_dims}Q", mm, pos)
            pos += 8 * n_dims
            ttype = _U32.unpack_from(mm, pos)[0]
            rel = _U64.unpack_from(mm, pos + 4)[0]
            pos += 12
            entries.append((name, shape, ttype, rel, start))

        self.data_offset = pos + (-pos) % self.alignment
        if self.data_offset > self.size and n_tensors:
            raise self._err(f"tensor data section starts at {self.data_offset}, past the end of the file")

        tensors: dict[str, TensorInfo] = {}
        for name, shape, ttype, rel, where in entries:
            try:
                qtype = GGMLQuantizationType(ttype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise self._err(f"tensor {name!r} has unknown ggml type id {ttype}", where) from None
            if any(d >= 1 << 62 for d in shape):
                raise self._err(f"tensor {name!r} has absurd shape {shape}", where)
            n_el = 1
            for d in shape:
                n_el *= d
            ne0 = shape[0] if shape else 1
            if ne0 % block:
                raise self._err(
                    f"tensor {name!r} ({qtype.name}) has ne0={ne0}, not a multiple of the block size {block}", where
                )
            nbytes = n_el // block * type_size
            if rel % self.alignment:
                raise self._err(
                    f"tensor {name!r} data offset {rel} is not aligned to {self.alignment}", where
                )
            start = self.data_offset + rel
            if nbytes > self.size or start + nbytes > self.size:
                raise self._err(
                    f"tensor {name!r} data [{start}, {start + nbytes}) lies past the end of the file ({self.size} bytes)",
                    where,
                )
            tensors[name] = TensorInfo(name, tuple(int(d) for d in shape), int(ttype), start, nbytes)

        by_offset = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(by_offset, by_offset[1:]):
            if a.offset + a.nbytes > b.offset:
                raise self._err(
                    f"tensor {a.name!r} data [{a.offset}, {a.offset + a.nbytes}) overlaps tensor {b.name!r} at {b.offset}"
                )
        self.tensors = tensors

        arch = raw.get("general.architecture")
        self.arch: str = arch if isinstance(arch, str) else ""

    def _value(self, vtype: int, pos: int, key: str) -> tuple[Any, int]:
        mm = self._mm
        sc = _SCALARS.get(vtype)
        if sc is not None:
            self._types[key] = (vtype, None)
            st = sc[0]
            self._need(pos, st.size, f"value of {key!r}")
            return st.unpack_from(mm, pos)[0], pos + st.size
        if vtype == GGUFValueType.STRING:
            self._types[key] = (vtype, None)
            return self._str(pos, f"value of {key!r}")
        if vtype != GGUFValueType.ARRAY:
            raise self._err(f"metadata {key!r} has unknown value type {vtype}", pos - 4)
        itype = self._u32(pos, f"array item type of {key!r}")
        count = self._u64(pos + 4, f"array length of {key!r}")
        pos += 12
        self._types[key] = (vtype, itype)
        sc = _SCALARS.get(itype)
        if sc is not None:
            dt = sc[1]
            self._need(pos, count * dt.itemsize, f"array {key!r} ({count} x {_TYPE_NAMES[itype]})")
            # Copy the (small) numeric arrays out of the mmap so metadata holds no
            # buffer exports and close() can unmap at once.
            arr = np.frombuffer(mm, dtype=dt, count=count, offset=pos).copy()
            return arr, pos + count * dt.itemsize
        if itype == GGUFValueType.STRING:
            self._need(pos, count * 8, f"string array {key!r} ({count} items)")
            return self._walk_strings(pos, count, key)
        if itype == GGUFValueType.ARRAY:
            raise self._err(f"metadata {key!r} is a nested array, which is not supported", pos - 12)
        raise self._err(f"metadata array {key!r} has unknown item type {itype}", pos - 12)

    def _walk_strings(self, pos: int, count: int, key: str) -> tuple[_LazyStrings, int]:
        # The format stores no total byte size, so skipping a string array means following each
        # length prefix: a Python loop over every item (~70 ms for Gemma 3's 262k tokens here). With
        # index_cache the offsets found once are kept on disk and, on the next open, checked against
        # the file in one vectorised pass instead of walked; decoding waits until the array is read.
        use_index = self._index_key is not None and count >= INDEX_MIN_ITEMS
        if use_index:
            starts = self._load_index(pos, count)
            if starts is not None:
                return _LazyStrings(starts[:-1], int(starts[-1]), key), int(starts[-1])
        unpack = _U64.unpack_from
        mm = self._mm
        offsets = [0] * count
        i = 0
        try:
            for i in range(count):
                n = unpack(mm, pos)[0]
                pos += 8
                offsets[i] = pos
                pos += n
        except (struct.error, OverflowError):
            raise self._err(
                f"string array {key!r}: length of item {i} of {count} runs past the end of the file", pos
            ) from None
        if pos > self.size:
            raise self._err(
                f"string array {key!r}: item {count - 1} of {count} runs past the end of the file ({pos} > {self.size})"
            )
        starts = np.array(offsets, dtype=np.int64)
        if use_index:
            self._store_index(starts, pos)
        return _LazyStrings(starts, pos, key), pos

    # ------------------------------------------------------------------ index cache
    def _index_path(self, starts_at: int) -> Path:
        from engine.files import cache_dir  # imported here to keep this module standalone

        return cache_dir() / "gguf-index" / f"{self._index_key}-{starts_at}.npy"

    def _load_index(self, pos: int, count: int) -> np.ndarray | None:
        """The cached item offsets (+ the array's end) of the string array at pos, if they are exactly
        what walking it would give; None otherwise (missing, stale or damaged: walk instead)."""
        try:
            cached = np.load(self._index_path(pos + 8), allow_pickle=False)
        except (OSError, ValueError):
            return None
        if cached.dtype != np.int64 or cached.ndim != 1 or len(cached) != count + 1:
            return None
        return cached if self._chain_holds(pos, cached[:-1], int(cached[-1])) else None

    def _chain_holds(self, pos: int, starts: np.ndarray, end: int) -> bool:
        """Whether starts/end are the string array at pos: item 0 starts after the first length prefix,
        each item starts right after the previous one ends (its u64 length read from the file) and the
        last one ends at end."""
        if starts[0] != pos + 8 or end > self.size or (starts[1:] <= starts[:-1]).any():
            return False
        with memoryview(self._mm) as view:
            data = np.frombuffer(view, dtype=np.uint8)
            prefix = data[(starts - 8)[:, None] + np.arange(8)]  # every item's length, gathered
            del data
        lengths = prefix.view("<u8").ravel().astype(np.int64)
        ends = starts + lengths
        return bool((lengths >= 0).all() and (ends[:-1] + 8 == starts[1:]).all() and ends[-1] == end)

    def _store_index(self, starts: np.ndarray, end: int) -> None:
        path = self._index_path(int(starts[0]))
        try:
            from engine.files import atomic_write

            with atomic_write(path, permissions=0o644) as f:  # other users' workers may share the cache
                np.save(f, np.append(starts, np.int64(end)))
            ident = self._index_key.split("-", 1)[0]
            for old in path.parent.glob(f"{ident}-*.npy"):  # entries of older versions of this file
                if not old.name.startswith(self._index_key):
                    old.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only cache only costs the walk next time

    def _decode_strings(self, lazy: _LazyStrings) -> list[str]:
        if self._mm is None:
            raise GGUFError(f"{self.path}: closed before {lazy.key!r} was read")
        count = len(lazy.starts)
        if count == 0:
            return []
        base = lazy.starts[0] - 8
        blob = self._mm[base : lazy.end]
        st, en = lazy.bounds()
        st -= base
        en -= base
        buf = np.frombuffer(blob, dtype=np.uint8)
        fast = _split_at_prefixes(buf, st, en)
        if fast is not None:
            return fast
        # An item holds a NUL, or the region is not valid UTF-8. Decode the whole region (length
        # prefixes included) in one go and slice the str. Valid when every length-prefix byte is
        # ASCII: then each item is bounded by ASCII bytes and is valid UTF-8 on its own.
        # (the prefix of item i is the u64 value en[i] - st[i]: ASCII iff no byte has its top bit set)
        prefix_ascii = not bool(((en - st).astype(np.uint64) & np.uint64(0x8080808080808080)).any())
        if prefix_ascii:
            try:
                text = blob.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None:
                cont = np.zeros(len(buf) + 1, dtype=np.int32 if len(buf) < 2**31 else np.int64)
                np.cumsum((buf & 0xC0) == 0x80, out=cont[1:])  # continuation bytes before each offset
                cs = (st - cont[st]).tolist()
                ce = (en - cont[en]).tolist()
                return [text[a:b] for a, b in zip(cs, ce)]
        out = []
        for i, (a, b) in enumerate(zip(st.tolist(), en.tolist())):
            try:
                out.append(blob[a:b].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise GGUFError(
                    f"{self.path}: string array {lazy.key!r} item {i} at offset {base + a} is not valid UTF-8 ({e.reason})"
                ) from None
        return out

    # ------------------------------------------------------------------ API
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata[key] if key in self.metadata else default

    def metadata_only(self) -> bytes:
        """This file's header and metadata as a GGUF of its own with no tensors: the tokenizer, chat
        template and configuration without the weights (kilobytes to megabytes, not gigabytes), for a
        process that only counts tokens or sizes caches."""
        if self._mm is None:
            raise GGUFError(f"{self.path}: file is closed")
        n_kv = _U64.unpack_from(self._mm, 16)[0]
        return bytes(self._mm[0:8]) + _U64.pack(0) + _U64.pack(n_kv) + bytes(self._mm[HEADER_SIZE:self.metadata_end])

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's bytes as a zero-copy uint8 view on the mmap."""
        if self._mm is None:
            raise GGUFError(f"{self.path}: file is closed")
        try:
            t = self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def advise_random_reads(self, except_tensors: Iterable[str] = ()) -> None:
        """Tell the kernel the tensor data is read in small scattered pieces (MADV_RANDOM), except
        the named tensors (read whole, as before). For a worker computing on the repacked cache: it
        reads only norms and embedding rows here, and a fault with the default read-around would
        read up to the device's read-ahead (8 MiB on some VMs) around each of them."""
        if self._mm is None or not hasattr(mmap, "MADV_RANDOM"):
            return
        page = mmap.PAGESIZE
        lo = self.data_offset - self.data_offset % page
        try:
            self._mm.madvise(mmap.MADV_RANDOM, lo, self.size - lo)
            for name in except_tensors:
                t = self.tensors[name]
                start = t.offset - t.offset % page
                self._mm.madvise(mmap.MADV_NORMAL, start, t.offset + t.nbytes - start)
        except OSError:   # advice only: a kernel that refuses it changes nothing we rely on
            pass

    def close(self) -> None:
        """Unmap the file.  If tensor_data() views are still alive the mapping is
        released when the last of them is garbage-collected instead."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # exported views keep it mapped until they are gone

    @property
    def closed(self) -> bool:
        return self._mm is None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, version={getattr(self, 'version', '?')}, arch={getattr(self, 'arch', '?')!r}, "
            f"{len(getattr(self, 'tensors', {}))} tensors, {len(getattr(self, '_raw', {}))} metadata keys)"
        )


"""The repacked weight cache: R16 copies of a model's matmul weights in one file, shared by every worker.

The AVX-512 VNNI kernels run faster on an interleaved layout, "R16" (16 rows per group; same values,
same results bit for bit: engine/kernels/quants.c). llama.cpp and ik_llama.cpp repack into private
memory in every process; here the first process to load a model writes the repacked matrices into
one file in the model cache, and every worker maps that file read-only (MAP_SHARED), so the page
cache holds one copy for all workers on a host. The GGUF stays mapped for what is not repacked
(norms, biases, the embedding rows looked up one at a time); its matmul weight pages are then no
longer touched.

    <cache>/repacked/<model stem>-<key>.r16     key: sha256(layout version, size, mtime_ns, header hash)[:16]

File format (little-endian):

    magic b"RQLLMR16" | u32 layout version | u32 header length | u32 crc32 of the header | u32 0
    header: UTF-8 JSON {"layout", "key", "source": {path, size, mtime_ns, header_sha256},
                        "file_size", "tensors": [[name, type, rows, cols, offset, nbytes,
                                                  source_offset, source_nbytes], ...]}
    each tensor's R16 bytes at its offset, a multiple of ALIGN (4096: page-aligned for the mapping,
    64-byte aligned for the kernels' loads), in the order of the table

On open the file is checked, never trusted blindly: magic, layout version, header checksum, the key
and source identity against the GGUF as it is now, the tensor table against the one this GGUF and
these kernels give, and the file's size. A cache that fails any check is rebuilt.

Writing is atomic and safe with concurrent first loads: the builder holds an exclusive flock on
`<final name>.lock` (waiting workers block there, then find the finished file instead of repacking
too), writes `.<final name>.<pid>.tmp` (space reserved with posix_fallocate first, so a disk that
fills up gives ENOSPC here rather than SIGBUS in the middle of the mapped writes), fsyncs it and
renames it to the final name. A builder that dies leaves only a temporary file, which the next
builder (holding the lock, so no one else can be writing it) deletes. The kernel drops a dead
process's flock, so nobody waits on it. Before writing, a builder also deletes the caches nothing
will open again (remove_stale): earlier versions of its own source, and caches of deleted sources.

LAYOUT_VERSION covers this file format (FORMAT_VERSION: bump it when the header or table changes)
and the kernels' R16 layout (quants.c's R16_V, read from the extension), so caches from older
builds are rebuilt instead of misread.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.files import atomic_path, cache_dir

log = logging.getLogger("rqllm.repack")

FORMAT_VERSION = 1


def _kernel_layout_version() -> int:
    """quants.c's R16 layout version: a layout change there makes old caches stale by itself."""
    try:
        from engine.kernels import _kernels
        return int(_kernels.r16_layout_version())
    except (ImportError, AttributeError):
        return 0


LAYOUT_VERSION = FORMAT_VERSION * 1000 + _kernel_layout_version()
MAGIC = b"RQLLMR16"
PREFIX = struct.Struct("<8sIIII")  # magic, layout version, header length, header crc32, reserved
ALIGN = 4096
GROUP_ROWS = 16
ENV_SWITCH = "RQLLM_REPACK"  # "0" (or off/false/no) computes on the GGUF layout
SUBDIR = "repacked"
MAX_HEADER_BYTES = 64 << 20  # far above any real table (~30 KB for an 8B model): a bigger one is corrupt
CHUNK_BYTES = 16 << 20  # repacked bytes per r16_repack call: progress, and the most of it our RSS holds
DISK_MARGIN_BYTES = 256 << 20  # free space left over after the cache is written
LOCK_LOG_INTERVAL = 10.0  # seconds between "still waiting for the builder" lines

Progress = Callable[[int, int], None]  # (bytes repacked so far, total bytes)


class RepackError(RuntimeError):
    """The cache cannot be built or used here; the message says why and how to do without it."""


class StaleCache(ValueError):
    """A cache file that does not match its source or is damaged; the message says how."""


# ---------------------------------------------------------------------------------------------
# the kernels' entry points


@dataclass(frozen=True)
class R16Kernels:
    """The compiled R16 entry points (engine.kernels._kernels); tests substitute fakes."""

    supported: Callable[[int], bool]  # r16_supported(type)
    nbytes: Callable[[int, int, int], int]  # r16_bytes(type, rows, cols)
    repack: Callable[..., None]  # r16_repack(type, W, rows, cols, out, g0, g1, nthreads)
    available: Callable[[], bool]  # r16_kernels_available(): the current kernel path reads R16


def r16_kernels() -> R16Kernels | None:
    """The kernels' R16 functions, or None when this build of the extension has none."""
    from engine.kernels import _kernels

    try:
        return R16Kernels(_kernels.r16_supported, _kernels.r16_bytes, _kernels.r16_repack,
                          _kernels.r16_kernels_available)
    except AttributeError:
        return None


@dataclass(frozen=True)
class Decision:
    enabled: bool
    reason: str


def decide(requested: bool | None) -> Decision:
    """Whether to compute on a repacked cache: requested False (--no-repack) or RQLLM_REPACK=0 turn
    it off; otherwise on when the kernel path in use reads R16 (today: avx512), since elsewhere the
    copy would only cost disk and time."""
    if requested is False:
        return Decision(False, "repacking turned off (--no-repack)")
    env = os.environ.get(ENV_SWITCH, "").strip().lower()
    if requested is None and env in ("0", "off", "false", "no"):
        return Decision(False, f"repacking turned off ({ENV_SWITCH}={os.environ[ENV_SWITCH]})")
    api = r16_kernels()
    if api is None:
        return Decision(False, "the compiled kernels have no R16 layout")
    if not api.available():
        from engine.kernels._kernels import kernel_path

        return Decision(False, f"the {kernel_path()} kernel path does not use the R16 layout")
    return Decision(True, "the kernel path reads R16")


# ---------------------------------------------------------------------------------------------
# what the cache holds


@dataclass(frozen=True)
class SourceIdentity:
    """What identifies the GGUF a cache was made from: a new download, an edit or a copy with
    another mtime all give another key."""

    path: str  # realpath; recorded to find superseded caches of the same file, not part of the key
    size: int
    mtime_ns: int
    header_sha256: str  # the GGUF header, metadata and tensor table (everything before the data)

    def key(self) -> str:
        text = f"{LAYOUT_VERSION}:{self.size}:{self.mtime_ns}:{self.header_sha256}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns,
                "header_sha256": self.header_sha256}


def source_identity(path: Path, data_offset: int) -> SourceIdentity:
    """Size, mtime and the hash of the first data_offset bytes (the GGUF's header and tables)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        digest = hashlib.sha256()
        pos = 0
        while pos < data_offset:  # a few MB at most (vocabularies): read, not mapped, to keep it simple
            block = os.pread(fd, min(1 << 22, data_offset - pos), pos)
            if not block:
                break
            digest.update(block)
            pos += len(block)
    finally:
        os.close(fd)
    return SourceIdentity(os.path.realpath(path), st.st_size, st.st_mtime_ns, digest.hexdigest())


@dataclass(frozen=True)
class CachedTensor:
    name: str
    type: int
    rows: int
    cols: int
    offset: int  # of its R16 bytes in the cache file
    nbytes: int
    source_offset: int  # of its bytes in the GGUF
    source_nbytes: int

    def as_row(self) -> list[Any]:
        return [self.name, self.type, self.rows, self.cols, self.offset, self.nbytes, self.source_offset,
                self.source_nbytes]

    @property
    def groups(self) -> int:
        return -(-self.rows // GROUP_ROWS)


@dataclass(frozen=True)
class CachePlan:
    """The cache a GGUF and these kernels give: its name, identity and tensor table."""

    model: str  # a file-name-safe stem of the GGUF
    source: SourceIdentity
    tensors: tuple[CachedTensor, ...]
    file_size: int
    skipped: tuple[str, ...] = ()  # matmul weights whose type R16 does not cover

    @property
    def key(self) -> str:
        return self.source.key()

    @property
    def filename(self) -> str:
        return f"{self.model}-{self.key}.r16"

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def header(self) -> bytes:
        return json.dumps({"layout": LAYOUT_VERSION, "key": self.key, "source": self.source.as_json(),
                           "file_size": self.file_size, "tensors": [t.as_row() for t in self.tensors]},
                          separators=(",", ":")).encode()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _repackable_rows(info: Any) -> int:
    """The rows of a matrix, or of a stack of experts' matrices ({cols, rows, n_expert}) whose each matrix
    is whole 16-row groups, so that expert e's groups start at e * rows / 16; else 0 (not repacked)."""
    shape = [int(n) for n in info.shape]
    if len(shape) == 2:
        return shape[1]
    if len(shape) == 3 and shape[1] % GROUP_ROWS == 0:
        return shape[1] * shape[2]
    return 0


def plan_cache(gguf: Any, names: Sequence[str], api: R16Kernels) -> CachePlan:
    """The table for `names` (the model's matmul weights, GGUF tensor names) of an open GGUFFile:
    the tensors whose type R16 covers, each at the next ALIGN boundary after the header."""
    chosen, skipped = [], []
    for name in dict.fromkeys(names):  # a tied output is token_embd: once
        info = gguf.tensors[name]
        # r16_bytes is 0 for a shape the type's R16 layout cannot hold
        if _repackable_rows(info) and api.supported(int(info.type)) and \
                api.nbytes(int(info.type), _repackable_rows(info), int(info.shape[0])) > 0:
            chosen.append(info)
        else:
            skipped.append(name)
    source = source_identity(Path(gguf.path), gguf.data_offset)
    # The header holds the offsets, which depend on the header's length: lay the data out after a
    # header sized for the largest numbers it can hold, then check it fits.
    provisional = [CachedTensor(i.name, int(i.type), _repackable_rows(i), int(i.shape[0]), 1 << 50,
                                int(api.nbytes(int(i.type), _repackable_rows(i), int(i.shape[0]))), 1 << 50, 1 << 50)
                   for i in chosen]
    stub = CachePlan(_safe_stem(Path(gguf.path)), source, tuple(provisional), 1 << 50, tuple(skipped))
    offset = _align(PREFIX.size + len(stub.header()))
    tensors = []
    for info, p in zip(chosen, provisional):
        tensors.append(CachedTensor(p.name, p.type, p.rows, p.cols, offset, p.nbytes, int(info.offset),
                                    int(info.nbytes)))
        offset = _align(offset + p.nbytes)
    return CachePlan(stub.model, source, tuple(tensors), offset, tuple(skipped))


def _safe_stem(path: Path) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", path.name.removesuffix(".gguf"))[:80] or "model"


def cache_root() -> Path:
    return cache_dir() / SUBDIR


def resident_change(gguf: Any, names: Sequence[str], still_read: Sequence[str] = (),
                    api: R16Kernels | None = None) -> tuple[int, int]:
    """(GGUF bytes the forward pass stops reading, bytes of the cache file it reads instead) when the
    cache for these weights is used; tensors in still_read (token_embd: the embedding lookup) keep
    their GGUF bytes counted. (0, 0) without R16 kernels or when nothing would be repacked."""
    api = api or r16_kernels()
    if api is None:
        return 0, 0
    plan = plan_cache(gguf, names, api)
    if not plan.tensors:
        return 0, 0
    replaced = sum(t.source_nbytes for t in plan.tensors if t.name not in still_read)
    return replaced, plan.file_size


# ---------------------------------------------------------------------------------------------
# reading


@dataclass
class RepackedWeights:
    """An open, validated cache: the read-only shared mapping and each tensor's address in it.
    Keep it alive as long as anything computes on the addresses."""

    path: Path
    plan: CachePlan
    built: bool = False  # this process wrote the file
    build_seconds: float = 0.0
    _mm: mmap.mmap | None = field(default=None, repr=False)
    _view: np.ndarray | None = field(default=None, repr=False)

    @property
    def addresses(self) -> dict[str, int]:
        if self._view is None:
            raise RepackError(f"{self.path}: closed")
        base = int(self._view.__array_interface__["data"][0])
        return {t.name: base + t.offset for t in self.plan.tensors}

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The R16 bytes of one tensor (a read-only view of the mapping)."""
        if self._view is None:
            raise RepackError(f"{self.path}: closed")
        t = next(t for t in self.plan.tensors if t.name == name)
        return self._view[t.offset: t.offset + t.nbytes]

    @property
    def group_bytes(self) -> dict[str, int]:
        """Bytes of one group of GROUP_ROWS rows per tensor: a slice of a tensor's rows from a
        group boundary on (a fused q|k|v) starts at its address plus whole groups."""
        return {t.name: t.nbytes // t.groups for t in self.plan.tensors}

    @property
    def nbytes(self) -> int:
        return self.plan.file_size

    def describe(self) -> str:
        how = f"built in {self.build_seconds:.1f} s" if self.built else "reused"
        return (f"repacked weights (R16) {self.path} ({len(self.plan.tensors)} matrices, "
                f"{self.plan.file_size / 1e9:.2f} GB, {how})")

    def close(self) -> None:
        self._view = None
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # views still alive keep it mapped until they go
                mm.close()


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a cache file, its prefix checked (magic, version, checksum); StaleCache if not."""
    with open(path, "rb") as f:
        prefix = f.read(PREFIX.size)
        if len(prefix) < PREFIX.size:
            raise StaleCache(f"{len(prefix)} bytes, shorter than the prefix")
        magic, version, length, crc, _ = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise StaleCache(f"magic {magic!r}, expected {MAGIC!r}")
        if version != LAYOUT_VERSION:
            raise StaleCache(f"layout version {version}, this build uses {LAYOUT_VERSION}")
        if length > MAX_HEADER_BYTES:
            raise StaleCache(f"header length {length} is absurd")
        raw = f.read(length)
    if len(raw) != length or zlib.crc32(raw) != crc:
        raise StaleCache("header checksum mismatch (damaged or truncated)")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise StaleCache(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise StaleCache("header is not a JSON object")
    return header


def check_header(header: dict[str, Any], plan: CachePlan, actual_size: int) -> None:
    """StaleCache unless the header is exactly what `plan` (the GGUF and kernels as they are now) gives."""
    if header.get("layout") != LAYOUT_VERSION:
        raise StaleCache(f"layout {header.get('layout')!r} in the header, expected {LAYOUT_VERSION}")
    # The path is not compared: the same file may be mounted elsewhere in another container.
    source = header.get("source")
    recorded = {k: v for k, v in source.items() if k != "path"} if isinstance(source, dict) else source
    expected = {k: v for k, v in plan.source.as_json().items() if k != "path"}
    if header.get("key") != plan.key or recorded != expected:
        raise StaleCache(f"made from another version of the source (key {header.get('key')!r}, now {plan.key})")
    if header.get("tensors") != [t.as_row() for t in plan.tensors]:
        raise StaleCache("its tensor table differs from the model's")
    if header.get("file_size") != plan.file_size or actual_size != plan.file_size:
        raise StaleCache(f"{actual_size} bytes, expected {plan.file_size} (truncated or extended)")


def open_cache(path: Path, plan: CachePlan) -> RepackedWeights:
    """Map a cache file read-only (MAP_SHARED) after checking it against `plan`; StaleCache if it
    does not match, FileNotFoundError if absent."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        check_header(read_header(path), plan, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    view = np.frombuffer(mm, dtype=np.uint8)
    return RepackedWeights(path, plan, _mm=mm, _view=view)


def try_open(path: Path, plan: CachePlan) -> RepackedWeights | None:
    """The cache at path when it is there and valid; None (with the reason logged) otherwise."""
    try:
        return open_cache(path, plan)
    except FileNotFoundError:
        return None
    except (StaleCache, OSError) as exc:
        log.warning("repacked cache %s is not usable (%s); it will be rebuilt", path, exc)
        return None


# ---------------------------------------------------------------------------------------------
# writing


def check_disk_space(directory: Path, plan: CachePlan) -> None:
    """RepackError naming the directory, the bytes needed and free, and the way out, when the cache
    would not fit with DISK_MARGIN_BYTES to spare."""
    free = shutil.disk_usage(directory).free
    need = plan.file_size + DISK_MARGIN_BYTES
    if free < need:
        raise RepackError(
            f"not enough free disk space for the repacked weight cache of {plan.model} in {directory}: "
            f"{need / 1e9:.2f} GB needed ({plan.file_size / 1e9:.2f} GB + {DISK_MARGIN_BYTES / 1e9:.2f} GB "
            f"margin), {free / 1e9:.2f} GB free. Free some space, point RQLLM_CACHE at a larger disk, or "
            f"run with --no-repack ({ENV_SWITCH}=0) to compute on the GGUF's own layout.")


@contextlib.contextmanager
def build_lock(final: Path, on_wait: Callable[[float], None] | None = None) -> Iterator[None]:
    """Hold the exclusive flock that serialises builders of `final`; on_wait(seconds) is called
    every LOCK_LOG_INTERVAL while another process holds it."""
    fd = os.open(final.with_name(final.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        t0 = time.monotonic()
        last = t0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if on_wait is not None and time.monotonic() - last >= LOCK_LOG_INTERVAL:
                    last = time.monotonic()
                    on_wait(last - t0)
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock


def _temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.{os.getpid()}.tmp")


def remove_leftovers(final: Path) -> None:
    """Temporary files of builders that died; only the lock holder calls this, so none is in use."""
    for tmp in final.parent.glob(f".{final.name}.*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()
            log.info("removed %s, left by a repack that did not finish", tmp)


def remove_stale(final: Path, source_path: str) -> None:
    """Other caches in the directory that nothing will open again, removed before a build so that
    their space is free for it: those of earlier versions of the same source file (same path, other
    key: 4.6 GB each for an 8B model), and orphans, whose source file was deleted (its folder is
    still here, the file is not; a folder that is missing may be a mount this container lacks, so
    those are kept). Workers still mapping one keep their pages until they exit."""
    for other in final.parent.glob("*.r16"):
        if other == final:
            continue
        try:
            source = read_header(other).get("source")
            recorded = source.get("path") if isinstance(source, dict) else None
        except (StaleCache, OSError):
            continue
        if not isinstance(recorded, str):
            continue
        if recorded == source_path:
            why = f"the repacked cache of an earlier version of {source_path}"
        elif Path(recorded).parent.is_dir() and not Path(recorded).exists():
            why = f"the repacked cache of {recorded}, which was deleted"
        else:
            continue
        with contextlib.suppress(OSError):
            other.unlink()
            other.with_name(other.name + ".lock").unlink(missing_ok=True)
            log.info("removed %s, %s", other, why)


def _page_range(offset: int, nbytes: int) -> tuple[int, int]:
    start = offset - offset % mmap.PAGESIZE
    return start, _round_page(offset + nbytes) - start


def _round_page(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def write_cache(plan: CachePlan, tmp: Path, api: R16Kernels, *, threads: int = 1,
                progress: Progress | None = None) -> None:
    """Write the whole cache into `tmp` (created, must not exist) and fsync it.

    The source is read through a mapping of its own and the output written through a shared
    mapping of the new file; after each chunk both ranges are dropped from this process's page
    tables (MADV_DONTNEED: the data stays in the page cache, dirty output pages are still written
    back), so building never keeps two copies of the weights in our RSS, nor even one tensor."""
    header = plan.header()
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.posix_fallocate(fd, 0, plan.file_size)  # ENOSPC now, not SIGBUS in a mapped write
        os.pwrite(fd, PREFIX.pack(MAGIC, LAYOUT_VERSION, len(header), zlib.crc32(header), 0) + header, 0)
        with open(plan.source.path, "rb") as src_file:
            st = os.fstat(src_file.fileno())
            if (st.st_size, st.st_mtime_ns) != (plan.source.size, plan.source.mtime_ns):
                raise RepackError(f"{plan.source.path} changed while the model was loading; load it again")
            src = mmap.mmap(src_file.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        dst = mmap.mmap(fd, plan.file_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            src.madvise(mmap.MADV_SEQUENTIAL)  # read ahead: each tensor is read once, front to back
            done = 0
            for t in plan.tensors:
                done = _repack_tensor(t, src, dst, api, threads, done, plan.data_bytes, progress)
            dst.flush()
        finally:
            # After an error the traceback may still hold views of the mappings: they are unmapped
            # when those go, and the original error is the one to report.
            for m in (src, dst):
                with contextlib.suppress(BufferError):
                    m.close()
        os.fsync(fd)
    finally:
        os.close(fd)


def _repack_tensor(t: CachedTensor, src: mmap.mmap, dst: mmap.mmap, api: R16Kernels, threads: int,
                   done: int, total: int, progress: Progress | None) -> int:
    """Repack one tensor in chunks of groups (progress; the pages of each chunk leave our page
    tables after it); returns the bytes done so far."""
    group_bytes = t.nbytes // t.groups
    source_group_bytes = t.source_nbytes // t.rows * GROUP_ROWS
    per_call = max(1, CHUNK_BYTES // max(group_bytes, 1))
    W = np.frombuffer(src, dtype=np.uint8, count=t.source_nbytes, offset=t.source_offset)
    out = np.frombuffer(dst, dtype=np.uint8, count=t.nbytes, offset=t.offset)
    try:
        for g0 in range(0, t.groups, per_call):
            g1 = min(t.groups, g0 + per_call)
            api.repack(t.type, W, t.rows, t.cols, out, g0, g1, threads)
            src_lo = t.source_offset + g0 * source_group_bytes
            src_hi = min(t.source_offset + g1 * source_group_bytes, t.source_offset + t.source_nbytes)
            src.madvise(mmap.MADV_DONTNEED, *_page_range(src_lo, src_hi - src_lo))
            dst.madvise(mmap.MADV_DONTNEED, *_page_range(t.offset + g0 * group_bytes, (g1 - g0) * group_bytes))
            if progress is not None:
                progress(done + g1 * group_bytes, total)
    finally:
        del W, out  # the mappings cannot close while numpy views export them
    return done + t.nbytes


def build(plan: CachePlan, final: Path, api: R16Kernels, *, threads: int = 1,
          progress: Progress | None = None) -> float:
    """Write the cache for `plan` atomically at `final` (the caller holds build_lock); returns seconds."""
    check_disk_space(final.parent, plan)
    t0 = time.perf_counter()
    # the final name only ever holds a complete file; write_cache fsyncs it
    with atomic_path(final, tmp=_temp_name(final), durable=True) as tmp:
        write_cache(plan, tmp, api, threads=threads, progress=progress)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# the entry point


def load_or_build(gguf: Any, names: Sequence[str], *, threads: int = 1, progress: Progress | None = None,
                  root: Path | None = None, force: bool = False, api: R16Kernels | None = None
                  ) -> RepackedWeights | None:
    """The validated, mapped cache for these matmul weights of an open GGUFFile, built first when
    missing, stale or damaged (force: rebuilt regardless). None when no tensor has a type R16
    covers. RepackError when it cannot be built (no kernels, disk space, an unwritable directory)."""
    api = api or r16_kernels()
    if api is None:
        raise RepackError("the compiled kernels have no R16 layout (rebuild the extension)")
    plan = plan_cache(gguf, names, api)
    if not plan.tensors:
        return None
    root = root or cache_root()
    final = root / plan.filename
    seconds = 0.0
    if not force and (cached := try_open(final, plan)) is not None:
        return cached
    try:
        root.mkdir(parents=True, exist_ok=True)
        with build_lock(final, on_wait=lambda s: log.info(
                "waiting %.0f s for another process to finish repacking %s", s, final)):
            cached = None if force else try_open(final, plan)  # finished while we waited
            if cached is not None:
                return cached
            remove_leftovers(final)
            remove_stale(final, plan.source.path)
            log.info("repacking %d weight matrices of %s into %s (%.2f GB, %d thread(s))", len(plan.tensors),
                     plan.model, final, plan.file_size / 1e9, threads)
            seconds = build(plan, final, api, threads=threads, progress=progress)
            log.info("repacked %s in %.1f s (%.0f MB/s)", final.name, seconds,
                     plan.data_bytes / 1e6 / max(seconds, 1e-9))
    except OSError as exc:
        raise RepackError(f"cannot write the repacked weight cache in {root}: {exc}. Run with --no-repack "
                          f"({ENV_SWITCH}=0) to compute on the GGUF's own layout.") from exc
    try:
        opened = open_cache(final, plan)
    except (StaleCache, OSError) as exc:
        raise RepackError(f"the repacked cache {final} just written does not read back: {exc}") from exc
    opened.built, opened.build_seconds = True, seconds
    return opened


class LogProgress:
    """Progress as log lines, every `step` of the total (workers: their log is the place to look)."""

    def __init__(self, label: str, step: float = 0.1, logger: logging.Logger = log):
        self.label, self.step, self.logger = label, step, logger
        self.t0 = time.perf_counter()
        self.next = step

    def __call__(self, done: int, total: int) -> None:
        if total and done / total >= self.next:
            self.next = (int(done / total / self.step) + 1) * self.step
            elapsed = time.perf_counter() - self.t0
            self.logger.info("repacking %s: %3.0f%% (%.2f of %.2f GB, %.0f s)", self.label, 100 * done / total,
                             done / 1e9, total / 1e9, elapsed)

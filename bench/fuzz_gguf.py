"""Fuzz the GGUF reader (engine.gguf_file.GGUFFile) and the model's validation (Config + Weights).

    python -m bench.fuzz_gguf                       # 100,000 inputs, 2 processes, findings -> /tmp/rqllm-fuzz
    python -m bench.fuzz_gguf --inputs 5000 --jobs 1 --seed 7

Inputs are derived from the real model files (SmolLM2 Q4_1, Gemma 3 Q4_K_M): each seed keeps the
real metadata (string/number arrays cut to a few hundred items so one input parses in about a
millisecond) and the real tensor table (names, shapes, types, offsets); the tensor data region is a
sparse hole of the real size, so an unmutated seed passes Model.load's validation. Each input is a
seed with 1-4 mutations: bit flips, byte sets, truncations, deleted/inserted/spliced byte ranges,
length fields (string lengths, array counts, kv/tensor counts, dims, offsets) set huge / "negative" /
just past the end, type ids (value, array item, ggml type, n_dims) out of range, duplicated tensor
names and metadata keys, tensor offsets past the end, a shrunk data region.

The only outcomes allowed: parsed (and validated), GGUFError or ModelError. A finding is any other
exception, our own GGUFError coming from the reader's catch-all safety net (an unchecked path), an
input taking more than --slow seconds of CPU, a hang (no progress for --timeout seconds: the child is killed) or
a crash of the child process (it is restarted after the input). Input i is fully determined by
(--seed, i), so every finding can be replayed: `--replay I` writes input I to a file and runs it here.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import resource
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import click
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.gguf_file import GGUFError, GGUFFile

ROOT = Path(__file__).resolve().parent.parent

ARRAY_CAP = 256  # items kept per metadata array in the seeds
MEMORY_LIMIT = 3 << 30  # address-space limit of a fuzzing child: runaway allocations become MemoryError

_SCALAR_FMT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}

U64_EDGES = (0, 1, 2, 7, 0x7F, 0xFF, 0xFFFF, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63,
             (1 << 64) - 2, (1 << 64) - 1)
U32_EDGES = (0, 1, 4, 5, 12, 13, 14, 31, 39, 40, 41, 255, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1)


# ------------------------------------------------------------------------------------------ seeds
@dataclass
class Seed:
    """A GGUF file in parts: metadata (key, type, item type, value), tensors (name, dims, type, offset)."""

    name: str
    version: int
    kvs: list[tuple[str, int, int | None, object]]
    tensors: list[tuple[str, tuple[int, ...], int, int]]
    alignment: int
    data_size: int


@dataclass
class Layout:
    """A serialized header and where its fields sit (for targeted mutations)."""

    header: bytearray
    size: int  # logical file size (header + padding + sparse data)
    u64_fields: list[int] = field(default_factory=list)  # counts, lengths, dims, offsets
    u32_fields: list[int] = field(default_factory=list)  # version, value/item types, n_dims, ggml types
    tensor_offsets: list[int] = field(default_factory=list)
    tensor_types: list[int] = field(default_factory=list)


def seed_from_model(path: Path) -> Seed:
    with GGUFFile(path) as g:
        kvs = []
        for key in g.metadata:
            vtype, itype = g.metadata.value_type(key)
            value = g.metadata[key]
            if vtype == GGUFValueType.ARRAY:
                value = list(value[:ARRAY_CAP]) if itype == GGUFValueType.STRING else value[:ARRAY_CAP].tolist()
            kvs.append((key, vtype, itype, value))
        tensors = [(t.name, t.shape, t.type, t.offset - g.data_offset) for t in g.tensors.values()]
        data_size = g.size - g.data_offset
        return Seed(path.name, g.version, kvs, tensors, g.alignment, data_size)


def _string(out: bytearray, lay: Layout, s: str | bytes) -> None:
    b = s.encode("utf-8") if isinstance(s, str) else s
    lay.u64_fields.append(len(out))
    out += struct.pack("<Q", len(b)) + b


def serialize(seed: Seed) -> Layout:
    out = bytearray()
    lay = Layout(out, 0)
    out += b"GGUF"
    lay.u32_fields.append(len(out))
    out += struct.pack("<I", seed.version)
    lay.u64_fields += [len(out), len(out) + 8]
    out += struct.pack("<QQ", len(seed.tensors), len(seed.kvs))
    for key, vtype, itype, value in seed.kvs:
        _string(out, lay, key)
        lay.u32_fields.append(len(out))
        out += struct.pack("<I", vtype)
        if vtype == GGUFValueType.STRING:
            _string(out, lay, value)
        elif vtype == GGUFValueType.ARRAY:
            lay.u32_fields.append(len(out))
            out += struct.pack("<I", itype)
            lay.u64_fields.append(len(out))
            out += struct.pack("<Q", len(value))
            if itype == GGUFValueType.STRING:
                for s in value:
                    _string(out, lay, s)
            else:
                out += struct.pack(f"<{len(value)}{_SCALAR_FMT[itype][1]}", *value)
        else:
            out += struct.pack(_SCALAR_FMT[vtype], value)
    for name, dims, ttype, offset in seed.tensors:
        _string(out, lay, name)
        lay.u32_fields.append(len(out))
        out += struct.pack("<I", len(dims))
        for d in dims:
            lay.u64_fields.append(len(out))
            out += struct.pack("<Q", d)
        lay.u32_fields.append(len(out))
        lay.tensor_types.append(len(out))
        out += struct.pack("<I", ttype)
        lay.u64_fields.append(len(out))
        lay.tensor_offsets.append(len(out))
        out += struct.pack("<Q", offset)
    data_offset = len(out) + (-len(out)) % seed.alignment
    lay.size = data_offset + seed.data_size
    return lay


# ------------------------------------------------------------------------------------------ mutations
class Chooser:
    """The random choices a mutation makes; backed by random.Random here, by hypothesis in the tests."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, items):
        return items[self.integer(0, len(items) - 1)]


def _structural(seed: Seed, c: Chooser) -> Seed:
    """Mutations that are easiest on the parts: duplicate names/keys, offsets and types, counts of dims."""
    kvs, tensors = list(seed.kvs), list(seed.tensors)
    op = c.integer(0, 6)
    if op == 0 and len(tensors) > 1:  # duplicated tensor name
        i, j = c.integer(0, len(tensors) - 1), c.integer(0, len(tensors) - 1)
        tensors[j] = (tensors[i][0],) + tensors[j][1:]
    elif op == 1 and len(kvs) > 1:  # duplicated metadata key
        i, j = c.integer(0, len(kvs) - 1), c.integer(0, len(kvs) - 1)
        kvs[j] = (kvs[i][0],) + kvs[j][1:]
    elif op == 2 and tensors:  # tensor offset past the end / misaligned / overlapping another
        i = c.integer(0, len(tensors) - 1)
        name, dims, ttype, off = tensors[i]
        choice = c.integer(0, 3)
        off = (seed.data_size + seed.alignment * c.integer(0, 4) if choice == 0 else
               off + c.integer(1, seed.alignment - 1) if choice == 1 else
               tensors[c.integer(0, len(tensors) - 1)][3] if choice == 2 else
               c.pick(U64_EDGES))
        tensors[i] = (name, dims, ttype, off)
    elif op == 3 and tensors:  # a known but different ggml type (shapes/sizes no longer match)
        i = c.integer(0, len(tensors) - 1)
        types = sorted(int(t) for t in GGML_QUANT_SIZES)
        tensors[i] = tensors[i][:2] + (c.pick(types),) + tensors[i][3:]
    elif op == 4 and tensors:  # dims added, removed, swapped, zeroed
        i = c.integer(0, len(tensors) - 1)
        name, dims, ttype, off = tensors[i]
        choice = c.integer(0, 3)
        dims = (dims + (c.pick((1, 2, 32, 1 << 40)),) if choice == 0 else dims[:-1] if choice == 1 else
                tuple(reversed(dims)) if choice == 2 else tuple(0 if k == 0 else d for k, d in enumerate(dims)))
        tensors[i] = (name, dims, ttype, off)
    elif op == 5 and kvs:  # a metadata value of the wrong type (e.g. block_count as a string or array)
        i = c.integer(0, len(kvs) - 1)
        key = kvs[i][0]
        kvs[i] = c.pick([(key, GGUFValueType.STRING, None, "abc"), (key, GGUFValueType.FLOAT32, None, -1.5),
                         (key, GGUFValueType.INT32, None, -7), (key, GGUFValueType.UINT64, None, (1 << 64) - 1),
                         (key, GGUFValueType.ARRAY, GGUFValueType.INT32, [1, 2, 3]),
                         (key, GGUFValueType.ARRAY, GGUFValueType.STRING, []),
                         (key, GGUFValueType.BOOL, None, True), (key, GGUFValueType.UINT32, None, 0)])
    elif op == 6:  # data region shrunk (the last tensors run past the end)
        return Seed(seed.name, seed.version, kvs, tensors, seed.alignment, c.integer(0, seed.data_size))
    return Seed(seed.name, seed.version, kvs, tensors, seed.alignment, seed.data_size)


def mutate(seeds: list[Seed], c: Chooser) -> tuple[bytes, int]:
    """One fuzz input: (header bytes, logical file size)."""
    seed = seeds[c.integer(0, len(seeds) - 1)]
    if c.integer(0, 3) == 0:
        seed = _structural(seed, c)
    lay = serialize(seed)
    buf, size = lay.header, lay.size
    for _ in range(c.integer(0 if len(seed.kvs) else 1, 3)):
        op = c.integer(0, 9)
        n = len(buf)
        if n == 0:
            break
        if op == 0:  # bit flip
            i = c.integer(0, n - 1)
            buf[i] ^= 1 << c.integer(0, 7)
        elif op == 1:  # byte set
            buf[c.integer(0, n - 1)] = c.integer(0, 255)
        elif op == 2:  # truncation (the file ends inside the header)
            cut = c.integer(0, n)
            del buf[cut:]
            size = cut
        elif op in (3, 4):  # a u64 length/count/dim/offset field: edge value, file size, off by one
            at = c.pick(lay.u64_fields)
            if at + 8 <= len(buf):
                old = struct.unpack_from("<Q", buf, at)[0]
                new = c.pick(U64_EDGES + (size, size + 1, max(size - at, 0), old + 1, max(old - 1, 0), old * 2,
                                          (old + 1) << 32, c.integer(0, (1 << 64) - 1)))
                struct.pack_into("<Q", buf, at, new % (1 << 64))
        elif op == 5:  # a u32 type id / n_dims / version out of range
            at = c.pick(lay.u32_fields)
            if at + 4 <= len(buf):
                struct.pack_into("<I", buf, at, c.pick(U32_EDGES + (c.integer(0, (1 << 32) - 1),)))
        elif op == 6:  # a tensor offset past the end of the file
            at = c.pick(lay.tensor_offsets) if lay.tensor_offsets else None
            if at is not None and at + 8 <= len(buf):
                struct.pack_into("<Q", buf, at, (size + c.integer(-64, 64 << 20)) % (1 << 64))
        elif op == 7:  # delete a range (everything after it shifts)
            i = c.integer(0, n - 1)
            del buf[i:i + c.integer(1, 64)]
            size -= n - len(buf)
        elif op == 8:  # insert bytes
            i = c.integer(0, n)
            buf[i:i] = bytes(c.integer(0, 255) for _ in range(c.integer(1, 16)))
            size += len(buf) - n
        else:  # splice: copy a chunk over another place
            i, j, k = c.integer(0, n - 1), c.integer(0, n - 1), c.integer(1, 64)
            chunk = buf[i:i + k]
            buf[j:j + len(chunk)] = chunk
    return bytes(buf[:size]), size


# ------------------------------------------------------------------------------------------ one input
ALLOWED = ("GGUFError", "ModelError")


def write_input(path: str, header: bytes, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, header)
        if size > len(header):
            os.ftruncate(fd, size)  # sparse: the tensor data region costs nothing
    finally:
        os.close(fd)


def check_file(path: str) -> str:
    """Parse + validate one file. Returns 'ok' or 'error'; raises on anything that is a finding."""
    from engine.model import Config, ModelError, Weights

    try:
        with GGUFFile(path) as g:
            for key in g.metadata:
                g.metadata[key]  # string arrays decode lazily: read them all
            cfg = Config.from_gguf(g)
            Weights(g, cfg)
        return "ok"
    except GGUFError as e:
        if "malformed GGUF (" in str(e):
            raise SafetyNetHit(str(e)) from e
        return "error"
    except ModelError:
        return "error"


class SafetyNetHit(Exception):
    """GGUFError raised by the reader's catch-all: an input reached an unchecked path."""


# ------------------------------------------------------------------------------------------ driver
def make_input(seeds: list[Seed], base_seed: int, index: int) -> tuple[bytes, int]:
    return mutate(seeds, Chooser(random.Random(base_seed * 1_000_003 + index)))


def _child(seeds: list[Seed], base_seed: int, start: int, stop: int, step: int, progress, findings, counts,
           workdir: str, slow: float) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    path = os.path.join(workdir, f"input-{os.getpid()}.gguf")
    for i in range(start, stop, step):
        progress.value = i
        header, size = make_input(seeds, base_seed, i)
        write_input(path, header, size)
        t0 = time.process_time()  # CPU time: a busy shared machine must not make inputs look slow
        try:
            outcome = check_file(path)
        except BaseException as e:  # noqa: BLE001 - everything that is not ours is a finding
            outcome = "finding"
            findings.put({"index": i, "kind": type(e).__name__, "message": str(e)[:300],
                          "where": traceback.format_exc().strip().splitlines()[-3:]})
        dt = time.process_time() - t0
        if dt > slow:
            findings.put({"index": i, "kind": "slow", "message": f"{dt:.2f} s of CPU", "where": []})
        with counts.get_lock():
            counts[{"ok": 0, "error": 1, "finding": 2}[outcome]] += 1
    progress.value = stop + step  # done


def run(n_inputs: int, jobs: int, base_seed: int, timeout: float, slow: float, workdir: str,
        models: list[Path]) -> dict:
    seeds = [seed_from_model(p) for p in models]
    ctx = mp.get_context("fork")
    findings = ctx.Queue()
    counts = ctx.Array("q", 3)
    out: list[dict] = []
    t0 = time.monotonic()
    lanes = []  # [next index, process, progress value, last index, last change time]
    for lane in range(jobs):
        lanes.append([lane, None, ctx.Value("q", -1), -1, time.monotonic()])

    def start(l):
        l[2].value = -1
        l[1] = ctx.Process(target=_child, args=(seeds, base_seed, l[0], n_inputs, jobs, l[2], findings, counts,
                                                workdir, slow), daemon=True)
        l[1].start()
        l[3], l[4] = -1, time.monotonic()

    for l in lanes:
        start(l)
    while any(l[1] is not None for l in lanes):
        time.sleep(0.2)
        while not findings.empty():
            out.append(findings.get())
        for l in lanes:
            proc = l[1]
            if proc is None:
                continue
            cur = l[2].value
            if cur != l[3]:
                l[3], l[4] = cur, time.monotonic()
            if not proc.is_alive():
                proc.join()
                if proc.exitcode != 0 and cur < n_inputs:  # crashed on input `cur`: record it, go on after it
                    out.append({"index": cur, "kind": "crash", "message": f"exit code {proc.exitcode}", "where": []})
                    with counts.get_lock():
                        counts[2] += 1
                    l[0] = cur + jobs
                    start(l)
                else:
                    l[1] = None
            elif cur >= 0 and time.monotonic() - l[4] > timeout:  # hang
                proc.kill()
                proc.join()
                out.append({"index": cur, "kind": "hang", "message": f"no progress for {timeout:g} s", "where": []})
                with counts.get_lock():
                    counts[2] += 1
                l[0] = cur + jobs
                start(l)
    while not findings.empty():
        out.append(findings.get())
    elapsed = time.monotonic() - t0
    ok, err, bad = counts[:]
    return {"inputs": ok + err + bad, "parsed_ok": ok, "our_errors": err, "findings": len(out),
            "seconds": round(elapsed, 1), "inputs_per_second": round((ok + err + bad) / elapsed, 1),
            "seed": base_seed, "jobs": jobs, "models": [p.name for p in models], "details": out}


def default_models() -> list[Path]:
    from engine.registry import KNOWN_MODELS, pull

    return [Path(pull(name, quiet=True)) for name in KNOWN_MODELS]


@click.command(help=__doc__)
@click.option("--inputs", type=int, default=100_000, show_default=True)
@click.option("--jobs", "n_procs", type=int, default=2, show_default=True, help="Fuzzing processes.")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--timeout", type=float, default=20.0, show_default=True,
              help="Seconds without progress that count as a hang.")
@click.option("--slow", type=float, default=2.0, show_default=True,
              help="CPU seconds after which one input is reported as slow.")
@click.option("--model", "seed_models", multiple=True, type=click.Path(path_type=Path),
              help="Seed GGUF file (repeatable; default: the known models).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              default=Path(tempfile.gettempdir()) / "rqllm-fuzz", show_default=True)
@click.option("--replay", type=int, default=None, help="Write input I to --out and check it in this process.")
def main(inputs: int, n_procs: int, seed: int, timeout: float, slow: float, seed_models: tuple[Path, ...], out: Path,
         replay: int | None) -> None:
    models = list(seed_models) or default_models()
    out.mkdir(parents=True, exist_ok=True)
    workdir = "/dev/shm" if os.path.isdir("/dev/shm") else str(out)
    if replay is not None:
        seeds = [seed_from_model(p) for p in models]
        header, size = make_input(seeds, seed, replay)
        path = str(out / f"input-{seed}-{replay}.gguf")
        write_input(path, header, size)
        print(f"{path}: {size} bytes (header {len(header)})")
        print(check_file(path))
        return
    report = run(inputs, n_procs, seed, timeout, slow, workdir, models)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    for f in report["details"][:50]:
        print(f"finding: input {f['index']}: {f['kind']}: {f['message']}  {' | '.join(f['where'])}")
    summary = {k: v for k, v in report.items() if k != "details"}
    print(json.dumps(summary))
    sys.exit(1 if report["findings"] else 0)


if __name__ == "__main__":
    main()

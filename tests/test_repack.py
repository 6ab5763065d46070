"""engine.repack: the repacked (R16) weight cache - written once, reused, rebuilt when stale or
damaged, atomic, refused with a clear message when the disk is too full; and, with the real
kernels, logits on it equal the GGUF layout's bit for bit while the GGUF's weight pages stay untouched.

The cache-file tests use tests/r16_fake.py's stand-in for the kernels' entry points, so they check
the file handling on any CPU; the last tests use the real kernels (avx512 path: skipped elsewhere).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine import repack
from engine.gguf_file import GGUFFile
from engine.model import Config, Model, Weights
from tests.conftest_redis import redis_server, redis_url  # noqa: F401
from tests.r16_fake import FakeR16

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def model_copy(tmp_path, smollm2_path) -> Path:
    """A private copy of SmolLM2 (its mtime and bytes are the test's to change)."""
    dst = tmp_path / "src" / "smol.gguf"
    dst.parent.mkdir()
    shutil.copyfile(smollm2_path, dst)
    return dst


def _build(model: Path, root: Path, fake: FakeR16, **kw) -> repack.RepackedWeights:
    with GGUFFile(model) as g:
        names = Weights(g, Config.from_gguf(g)).matmul_names()
        return repack.load_or_build(g, names, root=root, api=fake.api(), **kw)


def _finals(root: Path) -> list[Path]:
    return sorted(root.glob("*.r16"))


def test_written_once_then_reused(model_copy, tmp_path):
    root, fake = tmp_path / "cache", FakeR16()
    first = _build(model_copy, root, fake, threads=2)
    assert first.built and fake.calls > 0
    st = first.path.stat()
    calls = fake.calls
    second = _build(model_copy, root, fake)
    assert not second.built and fake.calls == calls  # nothing repacked again
    after = second.path.stat()
    assert (after.st_mtime_ns, after.st_ino, after.st_size) == (st.st_mtime_ns, st.st_ino, st.st_size)
    assert _finals(root) == [first.path]
    # The file holds every matmul weight of a type R16 covers, in the fake's layout, at the table's offsets.
    with GGUFFile(model_copy) as g:
        names = Weights(g, Config.from_gguf(g)).matmul_names()
        assert [t.name for t in second.plan.tensors] == names  # SmolLM2: all Q4_1, tied output = token_embd
        t = second.plan.tensors[3]
        raw = np.fromfile(second.path, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        src = g.tensor_data(t.name).reshape(t.rows, -1)
        got = raw.reshape(-1, src.shape[1])
        np.testing.assert_array_equal(got[:16], src[:16][::-1])
        assert t.offset % repack.ALIGN == 0
        del src
    first.close()
    second.close()


def test_rebuilt_when_the_source_changes(model_copy, tmp_path):
    root, fake = tmp_path / "cache", FakeR16()
    old = _build(model_copy, root, fake)
    old.close()
    # Same bytes, another mtime: another key.
    st = model_copy.stat()
    os.utime(model_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    new = _build(model_copy, root, fake)
    assert new.built and new.path != old.path
    assert _finals(root) == [new.path]  # the superseded copy of the same source is removed
    new.close()
    # Same size and mtime, one header byte changed (general.name): the header hash tells.
    data = bytearray(model_copy.read_bytes())
    at = data.index(b"Smollm2 135M")
    data[at] = ord("X")
    st = model_copy.stat()
    model_copy.write_bytes(bytes(data))
    os.utime(model_copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = _build(model_copy, root, fake)
    assert third.built and third.path != new.path and third.plan.source.mtime_ns == st.st_mtime_ns
    assert _finals(root) == [third.path]
    third.close()


def test_a_build_removes_the_caches_of_deleted_sources_but_not_of_unmounted_folders(model_copy, tmp_path):
    root, fake = tmp_path / "cache", FakeR16()
    deleted = model_copy.with_name("deleted.gguf")
    shutil.copyfile(model_copy, deleted)
    orphan = _build(deleted, root, fake)
    orphan.close()
    deleted.unlink()  # its folder is still here: the file was deleted, its cache is of no use
    elsewhere = tmp_path / "mount" / "elsewhere.gguf"
    elsewhere.parent.mkdir()
    shutil.copyfile(model_copy, elsewhere)
    kept = _build(elsewhere, root, fake)
    kept.close()
    shutil.rmtree(elsewhere.parent)  # a folder that is missing may be another container's mount
    current = _build(model_copy, root, fake)
    assert current.built
    assert _finals(root) == sorted([current.path, kept.path])
    assert not orphan.path.with_name(orphan.path.name + ".lock").exists()
    current.close()


@pytest.mark.parametrize("damage", ["truncate", "extend", "header_byte", "magic", "version", "table"])
def test_damaged_cache_is_rejected_and_rebuilt(model_copy, tmp_path, damage):
    root, fake = tmp_path / "cache", FakeR16()
    built = _build(model_copy, root, fake)
    path, plan = built.path, built.plan
    built.close()
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-4096]
    elif damage == "extend":
        data += bytes(4096)
    elif damage == "header_byte":
        data[repack.PREFIX.size + 10] ^= 0x01  # inside the JSON: the checksum no longer matches
    elif damage == "magic":
        data[0:8] = b"GGUF\0\0\0\0"
    elif damage == "version":
        data[8:12] = (repack.LAYOUT_VERSION + 1).to_bytes(4, "little")
    elif damage == "table":  # a valid header describing another table (checksum recomputed)
        header = plan.header().replace(b'"blk.0.attn_q.weight"', b'"blk.0.attn_x.weight"')
        data[repack.PREFIX.size:repack.PREFIX.size + len(header)] = header
        import zlib
        data[0:repack.PREFIX.size] = repack.PREFIX.pack(repack.MAGIC, repack.LAYOUT_VERSION, len(header),
                                                        zlib.crc32(header), 0)
    path.write_bytes(bytes(data))
    with pytest.raises(repack.StaleCache):
        repack.open_cache(path, plan)
    calls = fake.calls
    again = _build(model_copy, root, fake)
    assert again.built and fake.calls > calls and again.path == path
    assert path.stat().st_size == plan.file_size
    again.close()
    repack.open_cache(path, plan).close()  # valid again


def test_a_failing_writer_leaves_no_file(model_copy, tmp_path):
    root, fake = tmp_path / "cache", FakeR16(fail_after=20)
    with pytest.raises(RuntimeError, match="fake repack failure"):
        _build(model_copy, root, fake)
    assert _finals(root) == [] and list(root.glob(".*.tmp")) == []


_BUILDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.r16_fake import FakeR16
    from tests.test_repack import _build
    r = _build(Path(sys.argv[1]), Path(sys.argv[2]), FakeR16(delay=float(sys.argv[3])))
    print("RESULT built" if r.built else "RESULT reused", r.path, flush=True)
""")


def _builder(model: Path, root: Path, delay: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _BUILDER.format(root=str(ROOT)), str(model), str(root), str(delay)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "R16_FAKE_PRINT": "1"})


def test_a_killed_builder_leaves_no_final_file(model_copy, tmp_path):
    root = tmp_path / "cache"
    proc = _builder(model_copy, root, 0.05)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # wait until it is writing
        lines.append(line)
        if line.startswith("repacked"):
            break
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any(x.startswith("repacked") for x in lines), lines
    assert _finals(root) == []  # killed mid-way: no file under the final name
    assert len(list(root.glob(".*.tmp"))) == 1  # its partial temporary file
    fake = FakeR16()
    done = _build(model_copy, root, fake)  # the next load builds, and removes the leftover
    assert done.built and _finals(root) == [done.path] and list(root.glob(".*.tmp")) == []
    done.close()


def test_concurrent_first_loads_build_once(model_copy, tmp_path):
    root = tmp_path / "cache"
    procs = [_builder(model_copy, root, 0.002) for _ in range(3)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        results.append(next(line for line in out.splitlines() if line.startswith("RESULT")))
    assert sorted(r.split()[1] for r in results) == ["built", "reused", "reused"], results
    assert len({r.split()[2] for r in results}) == 1
    assert len(_finals(root)) == 1 and list(root.glob(".*.tmp")) == []
    fake = FakeR16()
    _build(model_copy, root, fake).close()
    assert fake.calls == 0


_Usage = namedtuple("_Usage", "total used free")


def test_too_little_disk_space_is_a_clear_error_and_the_engine_falls_back(model_copy, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from pipeline.cli import main

    root = tmp_path / "cache"
    monkeypatch.setattr(repack.shutil, "disk_usage", lambda path: _Usage(10**9, 10**9 - 5 * 10**6, 5 * 10**6))
    fake = FakeR16()
    with pytest.raises(repack.RepackError) as err:
        _build(model_copy, root, fake)
    message = str(err.value)
    assert str(root) in message and "GB needed" in message and "0.01 GB free" in message
    assert "--no-repack" in message and "RQLLM_REPACK=0" in message
    assert _finals(root) == [] and fake.calls == 0  # checked before writing anything

    # The engine still starts, on the GGUF layout, and says why.
    monkeypatch.setenv("RQLLM_CACHE", str(tmp_path / "envcache"))
    monkeypatch.setattr(repack, "r16_kernels", fake.api)
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # the worker stops "rqllm.repack" propagating: listen on it
    repack.log.addHandler(handler)
    try:
        model = Model.load(model_copy, threads=1, kv_budget="4MiB")
    finally:
        repack.log.removeHandler(handler)
    assert model.repacked is None and "not enough free disk space" in model.layout.reason
    assert any("not enough free disk space" in r.getMessage() for r in records)
    assert all(len(spec) == 4 for layer in model.weights.layers for spec in layer.values())

    # `rqllm models repack` fails with the message.
    result = CliRunner().invoke(main, ["models", "repack", str(model_copy)])
    assert result.exit_code == 1 and "not enough free disk space" in result.output
    assert "--no-repack" in result.output


def test_models_repack_command_prints_file_size_and_time(model_copy, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from pipeline.cli import main

    monkeypatch.setenv("RQLLM_CACHE", str(tmp_path / "c"))
    fake = FakeR16()
    monkeypatch.setattr(repack, "r16_kernels", fake.api)
    first = CliRunner().invoke(main, ["models", "repack", str(model_copy), "--threads", "1"])
    assert first.exit_code == 0, first.output
    line = first.stdout.strip().splitlines()[-1]
    path, size, how = line.split("\t")
    assert Path(path).is_file() and Path(path).parent == tmp_path / "c" / "repacked"
    assert size.endswith(" GB") and how.startswith("written in ")
    again = CliRunner().invoke(main, ["models", "repack", str(model_copy)])
    assert again.exit_code == 0 and "already up to date" in again.stdout
    # On a kernel path without R16 it refuses, unless --force.
    monkeypatch.setattr(repack, "r16_kernels", FakeR16(available=False).api)
    refused = CliRunner().invoke(main, ["models", "repack", str(model_copy)])
    assert refused.exit_code == 1 and "does not use the R16 layout" in refused.output
    forced = CliRunner().invoke(main, ["models", "repack", str(model_copy), "--force"])
    assert forced.exit_code == 0 and "written in" in forced.stdout


def test_the_decision(monkeypatch):
    fake = FakeR16()
    monkeypatch.setattr(repack, "r16_kernels", fake.api)
    monkeypatch.delenv(repack.ENV_SWITCH, raising=False)
    assert repack.decide(None).enabled and repack.decide(True).enabled
    assert not repack.decide(False).enabled and "--no-repack" in repack.decide(False).reason
    monkeypatch.setenv(repack.ENV_SWITCH, "0")
    assert not repack.decide(None).enabled and "RQLLM_REPACK=0" in repack.decide(None).reason
    assert repack.decide(True).enabled  # an explicit request wins over the environment
    monkeypatch.delenv(repack.ENV_SWITCH)
    monkeypatch.setattr(repack, "r16_kernels", FakeR16(available=False).api)
    assert not repack.decide(None).enabled and "does not use the R16 layout" in repack.decide(None).reason
    monkeypatch.setattr(repack, "r16_kernels", lambda: None)
    assert not repack.decide(None).enabled


def test_off_means_no_cache_and_gguf_specs(model_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("RQLLM_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(repack, "r16_kernels", FakeR16().api)
    model = Model.load(model_copy, threads=1, kv_budget="4MiB", repack=False)
    assert model.repacked is None and "--no-repack" in model.layout.reason
    assert not (tmp_path / "c" / "repacked").exists()
    assert all(len(spec) == 4 for layer in model.weights.layers for spec in layer.values())


def test_memory_plan_counts_the_repacked_file_instead_of_the_weights(smollm2_path, monkeypatch):
    from pipeline.memory_guard import plan

    fake = FakeR16()
    monkeypatch.setattr(repack, "r16_kernels", fake.api)
    off = plan(str(smollm2_path), "64MiB", repack=False)
    on = plan(str(smollm2_path), "64MiB")
    assert (off.replaced_bytes, off.repacked_bytes) == (0, 0) and off.weight_bytes == off.model_bytes
    with GGUFFile(smollm2_path) as g:
        names = Weights(g, Config.from_gguf(g)).matmul_names()
        matmul_only = sum(g.tensors[n].nbytes for n in names if n != "token_embd.weight")
        expected_file = repack.plan_cache(g, names, fake.api()).file_size
    # SmolLM2's output is its token_embd: still read for the lookup, so counted in the GGUF too.
    assert on.replaced_bytes == matmul_only and on.repacked_bytes == expected_file
    assert on.needed_bytes == off.model_bytes - matmul_only + expected_file + on.kv_bytes
    assert "read from the repacked cache" in on.describe()


def test_the_worker_logs_its_weight_layout_and_no_repack_reaches_it(model_copy, tmp_path, monkeypatch,
                                                                    redis_url):  # noqa: F811
    import logging

    import pipeline.worker as worker
    from pipeline.embedded import worker_argv

    monkeypatch.setenv("RQLLM_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(repack, "r16_kernels", FakeR16().api)
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    rq_log = logging.getLogger("rq.worker")  # rq's handlers do not propagate: listen on its own logger
    rq_log.addHandler(handler)
    loads = []
    real_load = worker.load_engine
    # Nothing is generated (burst, no jobs), so the fake R16 bytes are never multiplied by.
    monkeypatch.setattr(worker, "load_engine", lambda *a, **kw: loads.append(kw) or real_load(*a, **kw))
    try:
        worker.run_worker(str(model_copy), redis_url=redis_url, burst=True, name="layout-log", threads=1)
        worker.run_worker(str(model_copy), redis_url=redis_url, burst=True, name="layout-log2", threads=1,
                          repack=False)
    finally:
        rq_log.removeHandler(handler)
    started = [line for line in lines if "loaded in" in line]
    assert len(started) == 2, lines
    assert "weights: repacked weights (R16) " + str(tmp_path / "c" / "repacked") in started[0]
    assert "weights: GGUF layout: repacking turned off (--no-repack)" in started[1]
    assert [kw["repack"] for kw in loads] == [None, False]
    # the flag on the command line of embedded workers (rqllm submit --wait / summarize --no-repack)
    assert "--no-repack" in worker_argv("redis://x", "m", repack=False)
    assert "--no-repack" not in worker_argv("redis://x", "m")


# ---------------------------------------------------------------------------------------------
# the real kernels


def _real_r16_or_skip():
    from engine.kernels import _kernels as q

    if repack.r16_kernels() is None:
        pytest.skip("the kernels have no R16 entry points")
    if not q.r16_kernels_available():
        pytest.skip(f"the {q.kernel_path()} kernel path (RQLLM_KERNEL?) does not compute with R16 copies")


def _quant_model(smollm2_path: Path, name: str) -> Path:
    from tests.quant_models import requantized

    return requantized(smollm2_path, name)


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("r16-real")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)  # ~1 GB of repacked caches


# Every type's R16 kernels equal its GGUF-layout kernels bit for bit in tests/test_r16.py; here the whole
# model on the repacked cache. CI runs SmolLM2 (Q4_1), Gemma 3 (Q4_K, Q5_0, Q6_K, Q8_0) and SmolLM2 as Q8_0 and
# IQ4_XS; the other requantizations are marked slow (-m slow runs them), for CI's 20 minutes.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("which", ["smollm2", "gemma3", pytest.param("Q4_0", marks=_SLOW), pytest.param("Q5_0", marks=_SLOW),
                                   "Q8_0", pytest.param("Q4_K", marks=_SLOW), pytest.param("Q6_K", marks=_SLOW),
                                   pytest.param("IQ4_NL", marks=_SLOW), "IQ4_XS"])
def test_logits_on_the_repacked_cache_equal_the_gguf_layout_bit_for_bit(which, smollm2_path, gemma3_path,
                                                                        real_cache, monkeypatch):
    _real_r16_or_skip()
    path = {"smollm2": smollm2_path, "gemma3": gemma3_path}.get(which) or _quant_model(smollm2_path, which)
    monkeypatch.setenv("RQLLM_CACHE", str(real_cache))  # after the test model is found in the usual cache
    ids = [(7 + 13 * i) % 30000 + 100 for i in range(70)]  # prefill tiles, then decode steps
    plain = Model.load(path, threads=2, kv_budget="16MiB", repack=False)
    want = plain.forward_all(ids)
    want_steps = [plain.forward([ids[i]], 70 + i).copy() for i in range(5)]
    del plain
    packed = Model.load(path, threads=2, kv_budget="16MiB")
    assert packed.repacked is not None, packed.layout.reason
    used = sum(len(s) == 5 for layer in packed.weights.layers for s in layer.values())
    assert used >= len(packed.weights.layers), "the specs do not point at the repacked copies"
    got = packed.forward_all(ids)
    got_steps = [packed.forward([ids[i]], 70 + i).copy() for i in range(5)]
    assert np.array_equal(got, want), np.abs(got - want).max()
    for a, b in zip(got_steps, want_steps):
        assert np.array_equal(a, b)
    # A second load maps the same file instead of writing it again.
    again = Model.load(path, threads=2, kv_budget="16MiB")
    assert again.repacked is not None and not again.repacked.built and again.repacked.path == packed.repacked.path


_RSS_PROBE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    from engine.model import Model
    m = Model.load(sys.argv[1], threads=2, kv_budget="16MiB")
    m.forward_all(list(range(100, 164)))
    for i in range(4):
        m.forward([200 + i], 64 + i)
    rss, current = {{}}, None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            current = head[5] if len(head) > 5 else None
        elif head[0] == "Rss:" and current:
            rss[current] = rss.get(current, 0) + int(head[1]) * 1024
    print(json.dumps({{"rss": rss, "cache": str(m.repacked.path) if m.repacked else None,
                      "built": bool(m.repacked and m.repacked.built)}}))
""")


def _evict_from_page_cache(path: Path) -> None:
    """Drop a file nobody maps from the page cache, so the next reads come from disk page by page."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_the_gguf_weight_pages_are_not_touched_when_the_cache_is_used(smollm2_path, real_cache, tmp_path):
    """What the memory guard assumes: with the cache, the forward pass reads the matmul weights from
    it and not from the GGUF, so a worker's resident weights are the cache + the GGUF's small rest.

    Measured on a private copy of the GGUF, dropped from the page cache before the probe: a page
    cache holding the file in large folios (ext4 since 6.16, after a download or a sequential read)
    lets one fault map a whole folio, up to 2 MiB around a 2 KiB norm, which would say nothing about
    what the engine reads. From disk, the engine's random-read advice (engine.gguf_file
    advise_random_reads) makes each read map its own pages only."""
    import json

    _real_r16_or_skip()
    gguf = tmp_path / "smollm2-copy.gguf"
    shutil.copyfile(smollm2_path, gguf)
    env = {**os.environ, "RQLLM_CACHE": str(real_cache)}
    run = lambda: json.loads(subprocess.run(  # noqa: E731
        [sys.executable, "-c", _RSS_PROBE.format(root=str(ROOT)), str(gguf)], env=env, cwd=ROOT,
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    assert run()["built"]  # builds the copy's cache (reading the whole GGUF): the probe below is a plain load
    _evict_from_page_cache(gguf)
    probe = run()
    assert probe["cache"] and not probe["built"]
    gguf_rss = probe["rss"].get(str(gguf.resolve()), 0)
    cache_rss = probe["rss"].get(probe["cache"], 0)
    with GGUFFile(gguf) as g:
        names = set(Weights(g, Config.from_gguf(g)).matmul_names())
        rest = g.data_offset + sum(t.nbytes for n, t in g.tensors.items() if n not in names)
        size = g.size
    # The header (vocabulary), norms, 68 embedding rows, and the kernel's fault-around (64 KiB) of
    # pages already read; the matmul weights are ~95% of the file: a pass reading them from the
    # GGUF would map them all.
    assert gguf_rss <= rest + (8 << 20), (gguf_rss, rest, size)
    assert gguf_rss < 0.25 * size
    cache_size = Path(probe["cache"]).stat().st_size
    assert cache_rss >= 0.9 * cache_size, (cache_rss, cache_size)

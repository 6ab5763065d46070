"""Start-up paths: the GGUF string-array index cache, the vectorised string decoding, the
worker's "ready" line that bench/bench_startup.py times."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.gguf_file import INDEX_MIN_ITEMS, GGUFFile

# Items with multi-byte UTF-8, empty ones, long ones; NUL only where a test puts one.
ITEMS = [f"tok{i}" if i % 7 else f"é{i}日本🙂" for i in range(INDEX_MIN_ITEMS + 10)]
ITEMS[3] = ""
ITEMS[11] = "x" * 300


def _write(path: Path, strings: list[str]) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("test.strings", strings)
    w.add_uint32("test.after", 42)  # a key after the array: found only if the array was skipped right
    w.add_tensor("t", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _opens(monkeypatch) -> list[str]:
    """Record how each index-cached open got its offsets: 'walked' (and stored) or 'cached'."""
    seen: list[str] = []
    store, load = GGUFFile._store_index, GGUFFile._load_index

    def spy_store(self, *a):
        seen.append("walked")
        return store(self, *a)

    def spy_load(self, *a):
        got = load(self, *a)
        if got is not None:
            seen.append("cached")
        return got

    monkeypatch.setattr(GGUFFile, "_store_index", spy_store)
    monkeypatch.setattr(GGUFFile, "_load_index", spy_load)
    return seen


def test_index_cache_is_used_and_a_damaged_one_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("RQLLM_CACHE", str(tmp_path / "cache"))
    path = _write(tmp_path / "m.gguf", ITEMS)
    seen = _opens(monkeypatch)

    with GGUFFile(path, index_cache=True) as g:
        assert g.get("test.strings") == ITEMS and g.get("test.after") == 42
    [index] = list((tmp_path / "cache" / "gguf-index").glob("*.npy"))
    with GGUFFile(path, index_cache=True) as g:
        assert g.get("test.strings") == ITEMS and g.get("test.after") == 42
    assert seen == ["walked", "cached"]

    # An index that no longer matches the file (one offset off) is refused and rebuilt, never used.
    bad = np.load(index)
    bad[5] += 1
    np.save(index, bad)
    with GGUFFile(path, index_cache=True) as g:
        assert g.get("test.strings") == ITEMS and g.get("test.after") == 42
    assert seen == ["walked", "cached", "walked"]
    assert np.array_equal(np.load(index)[5], bad[5] - 1)

    # Off by default: a plain open neither reads nor writes the cache.
    with GGUFFile(path) as g:
        assert g.get("test.strings") == ITEMS
    assert seen == ["walked", "cached", "walked"]


def test_index_cache_entry_of_an_older_file_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("RQLLM_CACHE", str(tmp_path / "cache"))
    path = _write(tmp_path / "m.gguf", ITEMS)
    GGUFFile(path, index_cache=True).close()
    changed = ITEMS[:-1] + ["a different last item"]
    _write(path, changed)  # same path, new size/mtime
    with GGUFFile(path, index_cache=True) as g:
        assert g.get("test.strings") == changed
    assert len(list((tmp_path / "cache" / "gguf-index").glob("*.npy"))) == 1


def test_strings_holding_nul_decode_exactly(tmp_path):
    # The fast decoder splits at NULs it puts in place of length prefixes; an item holding a NUL
    # itself must send it to the exact path.
    items = ["a\x00b", "", "\x00", "日本\x00語", "end"]
    with GGUFFile(_write(tmp_path / "nul.gguf", items)) as g:
        assert g.get("test.strings") == items


def test_real_vocabularies_agree_with_gguf_reader(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("RQLLM_CACHE", str(tmp_path))
    reader = gguf.GGUFReader(smollm2_path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        field = reader.fields[key]
        expected = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        for _ in range(2):  # walked, then from the index
            with GGUFFile(smollm2_path, index_cache=True) as g:
                assert g.get(key) == expected


@pytest.mark.timeout(120)
def test_worker_says_when_it_is_ready(smollm2_path, tmp_path):
    from pipeline.embedded import RedisServer, subprocess_env, worker_argv
    from pipeline.worker import READY_LINE

    with RedisServer() as server:
        cmd = worker_argv(server.url, str(smollm2_path), threads=1, kv_budget="16MiB", name="ready-test")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=subprocess_env(cmd.redis_url),
                                cwd=str(Path(__file__).resolve().parents[1]))
        lines = []
        try:
            for raw in proc.stdout:
                lines.append(raw.decode(errors="replace"))
                if READY_LINE in lines[-1]:
                    break
        finally:
            proc.terminate()
            proc.communicate(timeout=30)
        assert f"ready-test: {READY_LINE} on rqllm:" in lines[-1], "".join(lines)
        # said after rq's start-up (registration, which comes after loading the engine)
        text = "".join(lines)
        assert text.index("started with PID") < text.index(READY_LINE)


def test_engine_starts_without_jinja2_and_builds_the_chat_format_on_first_use(smollm2_path):
    code = (
        "import sys\n"
        "from engine.engine import Engine\n"
        f"eng = Engine({str(smollm2_path)!r}, threads=1, kv_budget='16MiB')\n"
        "print('jinja2' in sys.modules, 'gguf' in sys.modules)\n"
        "text = eng.render_chat([{'role': 'user', 'content': 'hi'}])\n"
        "print('jinja2' in sys.modules, repr(text))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == "False False"  # neither Jinja2 nor the gguf package loaded to start
    assert second.startswith("True ") and "<|im_start|>user\\nhi<|im_end|>" in second

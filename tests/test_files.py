"""engine.files: the one atomic write and the one cache directory every layer uses."""
from __future__ import annotations

import os

import pytest

from engine.files import atomic_write, cache_dir


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_write(target, "w") as f:
            f.write("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_write_replaces_the_file_whole_with_the_asked_permissions(tmp_path):
    target = tmp_path / "sub" / "index.npy"  # the directory is made
    with atomic_write(target, durable=True, permissions=0o644) as f:
        f.write(b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert os.stat(target).st_mode & 0o777 == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["index.npy"]


def test_the_temporary_file_lives_where_it_is_told(tmp_path):
    (tmp_path / "tmp").mkdir()
    with atomic_write(tmp_path / "files" / "file-1", tmp_dir=tmp_path / "tmp") as f:
        seen = os.listdir(tmp_path / "tmp")
        f.write(b"x")
    assert len(seen) == 1 and os.listdir(tmp_path / "tmp") == []
    assert (tmp_path / "files" / "file-1").read_bytes() == b"x"


def test_every_cache_follows_rqllm_cache(tmp_path, monkeypatch):
    from engine.tokenizer import _cache_paths

    monkeypatch.setenv("RQLLM_CACHE", str(tmp_path / "c"))
    monkeypatch.delenv("RQLLM_TOKENIZER_CACHE", raising=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert cache_dir() == tmp_path / "c"
    beside, shared = _cache_paths(model)
    assert beside.parent == tmp_path and shared.parent == tmp_path / "c" / "tokenizers"


def test_the_cache_defaults_to_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("RQLLM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "rqllm"

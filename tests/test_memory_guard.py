"""pipeline.memory_guard: a worker refuses to start when model + KV cache exceed its memory, says why."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.memory_guard import ENV_SKIP, MemoryGuardError, cgroup_limit, check_worker_start, plan

ROOT = Path(__file__).resolve().parent.parent


def _big_context_gguf(path: Path) -> Path:
    """Header of a llama model with a 16M-token context: 1 MiB of KV per token, so a 1 TiB budget is
    really used (the real models' contexts cap their KV cache at a few hundred MiB)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(32)
    w.add_context_length(1 << 24)
    w.add_embedding_length(4096)
    w.add_feed_forward_length(11008)
    w.add_head_count(32)
    w.add_head_count_kv(32)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _worker(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", "worker", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_worker_refuses_a_kv_budget_beyond_memory_fast_and_names_the_numbers(tmp_path):
    model = _big_context_gguf(tmp_path / "big.gguf")
    # No Redis listens on port 1: the guard must answer before any connection (and before loading).
    p = _worker("--model", str(model), "--kv-budget", "1TiB", "--redis-url", "redis://127.0.0.1:1/0",
                env={ENV_SKIP: ""})
    assert p.returncode == 1, (p.stdout, p.stderr)
    err = " ".join(p.stderr.split())
    assert "not starting the worker" in err
    assert "KV cache 1024.0 GiB" in err and "big.gguf" in err
    assert "available (MemAvailable" in err or "available (cgroup limit" in err
    assert "--no-memory-check" in err
    # Stopped before Redis (a connection attempt to port 1 would log "Connection refused" after ~30 s
    # of retries) and so before the engine, which loads after connecting.
    assert "Traceback" not in p.stderr and "Connection" not in p.stderr and "loaded in" not in p.stderr


def test_no_memory_check_lets_an_expert_start_anyway(tmp_path, monkeypatch):
    model = _big_context_gguf(tmp_path / "big.gguf")
    monkeypatch.delenv(ENV_SKIP, raising=False)
    with pytest.raises(MemoryGuardError, match="not starting the worker"):
        check_worker_start(str(model), "1TiB")
    # Past the memory comparison the tensor table is checked: this header-only file has no weights.
    with pytest.raises(MemoryGuardError, match="cannot use the model: .*token_embd.weight has shape"):
        check_worker_start(str(model), "1TiB", memory_check=False)
    assert not plan(str(model), "1TiB").fits
    monkeypatch.setenv(ENV_SKIP, "1")
    with pytest.raises(MemoryGuardError, match="cannot use the model"):
        check_worker_start(str(model), "1TiB")
    # the flag on the real command
    r = _worker("--model", str(model), "--kv-budget", "1TiB", "--no-memory-check", "--redis-url",
                "redis://127.0.0.1:1/0", env={ENV_SKIP: ""})
    assert r.returncode == 1 and "not starting the worker" not in r.stderr
    assert "cannot use the model" in r.stderr and "the metadata implies" in r.stderr


def test_plan_counts_the_model_once_and_the_kv_the_cache_will_allocate(smollm2_path):
    small = plan(str(smollm2_path), "64MiB")
    assert small.model_bytes == smollm2_path.stat().st_size
    assert small.kv_bytes <= 64 << 20 and small.kv_tokens < small.max_tokens
    # SmolLM2: 30 layers x 3 KV heads x 64 dims, K and V in f16 (the default) -> 23040 bytes a token,
    # 8192 tokens at most
    huge = plan(str(smollm2_path), "1TiB")
    assert (huge.kv_tokens, huge.kv_bytes) == (8192, 8192 * 30 * 2 * 192 * 2)
    # the weights count once: the GGUF, or with the repacked cache its rest plus the cache file
    assert huge.fits and huge.needed_bytes == huge.model_bytes - huge.replaced_bytes + huge.repacked_bytes + huge.kv_bytes
    off = plan(str(smollm2_path), "1TiB", repack=False)
    assert off.needed_bytes == off.model_bytes + off.kv_bytes
    assert "capped by the model's context length" in huge.describe()


def test_bad_model_file_is_reported_before_loading(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    p = _worker("--model", str(bad), "--redis-url", "redis://127.0.0.1:1/0")
    assert p.returncode == 1
    assert "not a GGUF file: magic is b'NOPE'" in p.stderr and "Traceback" not in p.stderr
    with pytest.raises(MemoryGuardError, match="cannot read 'lots' as a byte size"):
        plan(str(_big_context_gguf(tmp_path / "ok.gguf")), "lots")


def test_shapes_that_do_not_match_the_metadata_are_refused_at_start(tmp_path, smollm2_path):
    # SmolLM2 with its embedding length claimed to be 594 instead of 576 (a head dimension of 66, still
    # room for its 64 rotated dimensions): every tensor disagrees.
    data = bytearray(Path(smollm2_path).read_bytes())
    key = b"llama.embedding_length"
    at = data.index(key) + len(key) + 4  # past the key and its value type
    assert int.from_bytes(data[at:at + 4], "little") == 576
    data[at:at + 4] = (594).to_bytes(4, "little")
    bad = tmp_path / "shapes.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(MemoryGuardError, match=r"token_embd.weight has shape \[576, 49152\], the metadata implies \[594, 49152\]"):
        check_worker_start(str(bad), "64MiB")


def test_cgroup_limits_v1_and_v2(tmp_path):
    # The fake hierarchy holds a limit at its top for both layouts; whichever this machine's
    # /proc/self/cgroup names (v1 "memory" or v2 ""), the top-level file is among the candidates.
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("2147483648\n")
    found = cgroup_limit(tmp_path)
    assert found is not None and found[0] in (1 << 30, 2 << 30)
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 "unlimited"
    assert cgroup_limit(tmp_path) is None

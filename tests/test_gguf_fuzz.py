"""A short fuzz run of the GGUF reader + model validation (the long one: python -m bench.fuzz_gguf),
and regression tests for what the fuzzer found.

The inputs come from bench/fuzz_gguf.py's mutator over seeds built from the real model files; here
hypothesis makes the mutator's choices, so a failure is shrunk to a small set of mutations.
"""
from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.gguf_file import GGUFError, GGUFFile
from engine.model import Config, ModelError

from bench import fuzz_gguf as fuzz


class HypothesisChooser(fuzz.Chooser):
    def __init__(self, data):
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


@pytest.fixture(scope="module")
def seeds(smollm2_path, gemma3_path):
    return [fuzz.seed_from_model(Path(smollm2_path)), fuzz.seed_from_model(Path(gemma3_path))]


def test_unmutated_seeds_pass_model_validation(seeds, tmp_path):
    # The seeds are faithful: the real tensor table and metadata, so Config + Weights accept them.
    for seed in seeds:
        lay = fuzz.serialize(seed)
        path = str(tmp_path / f"{seed.name}")
        fuzz.write_input(path, bytes(lay.header), lay.size)
        assert fuzz.check_file(path) == "ok"


def test_seeded_fuzz_run_only_our_errors(seeds, tmp_path):
    """1,200 inputs of the benchmark's own sequence (seed 1, inputs 0..1199: replay any failure with
    `python -m bench.fuzz_gguf --seed 1 --replay I`); any exception but GGUFError/ModelError fails."""
    path = str(tmp_path / "input.gguf")
    outcomes = {"ok": 0, "error": 0}
    for i in range(1200):
        header, size = fuzz.make_input(seeds, 1, i)
        fuzz.write_input(path, header, size)
        outcomes[fuzz.check_file(path)] += 1
    assert outcomes["error"] > 600 and outcomes["ok"] > 60, outcomes


def test_short_fuzz_run_only_our_errors(seeds, tmp_path):
    """Hypothesis-driven mutations (failures shrink to a few mutations); only our errors allowed."""
    path = str(tmp_path / "input.gguf")
    outcomes = {"ok": 0, "error": 0}
    slowest = [0.0]

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        header, size = fuzz.mutate(seeds, HypothesisChooser(data))
        fuzz.write_input(path, header, size)
        t0 = time.process_time()  # CPU time: a busy machine must not fail the test
        outcomes[fuzz.check_file(path)] += 1
        slowest[0] = max(slowest[0], time.process_time() - t0)

    run()
    assert outcomes["error"] > 50 and outcomes["ok"] > 5, outcomes  # the mutations reach both outcomes
    assert slowest[0] < 2.0  # CPU seconds for one input: no near-hang


# --------------------------------------------------------------------------- regressions (fuzz findings)

def _llama_header(path: Path, **overrides) -> Path:
    """A llama header (no weights needed for Config) with some metadata replaced by other types."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    values = {"llama.block_count": 2, "llama.context_length": 256, "llama.embedding_length": 64,
              "llama.feed_forward_length": 128, "llama.attention.head_count": 2}
    values.update(overrides)
    for key, value in values.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif value < 0:
            w.add_int32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("key, value, message", [
    # found: int("abc") -> ValueError, int([..]) -> TypeError, sqrt(negative head dim) -> math domain error
    ("llama.block_count", "abc", "llama.block_count should be an integer, is str abc"),
    ("llama.attention.head_count", [1, 2, 3], "llama.attention.head_count should be an integer, is ndarray"),
    ("llama.context_length", [4, 5], "llama.context_length should be an integer"),
    ("llama.attention.key_length", -4, "llama.attention.key_length = -4 is out of range"),
    ("llama.embedding_length", -64, "llama.embedding_length = -64 is out of range"),
    ("llama.block_count", 2.5, "llama.block_count should be an integer, is float"),
    ("llama.rope.freq_base", "fast", "llama.rope.freq_base should be a number, is str"),
    ("llama.vocab_size", "many", "llama.vocab_size should be an integer"),
])
def test_wrongly_typed_metadata_is_a_model_error(tmp_path, key, value, message):
    path = _llama_header(tmp_path / "typed.gguf", **{key: value})
    with GGUFFile(path) as g, pytest.raises(ModelError, match=f"{g.path}: metadata key {message}"):
        Config.from_gguf(g)


def test_huge_tensor_name_or_key_length_refused_before_reading(tmp_path):
    # found: a name length set to ~100 MB in a (sparse) 100 MB file made the reader copy and decode it
    # (0.6 s per input); names and keys have format limits, checked first.
    src = _llama_header(tmp_path / "src.gguf")
    with GGUFFile(src) as g:
        end = g.data_offset
    data = bytearray(src.read_bytes())
    name_at = data.index(b"token_embd.weight") - 8
    key_at = data.index(b"general.architecture") - 8
    for at, pattern in ((name_at, r"name of tensor #0 is 100000000 bytes long \(at most 63 allowed\)"),
                        (key_at, r"metadata key #0 is 100000000 bytes long \(at most 65535 allowed\)")):
        bad = bytearray(data)
        struct.pack_into("<Q", bad, at, 100_000_000)
        path = tmp_path / "long.gguf"
        path.write_bytes(bytes(bad[:end]))
        os.truncate(path, 200_000_000)  # sparse: the claimed bytes exist
        t0 = time.process_time()
        with pytest.raises(GGUFError, match=pattern):
            GGUFFile(path)
        assert time.process_time() - t0 < 0.1


def test_huge_string_value_length_over_invalid_bytes_fails_fast(tmp_path):
    # found (full run, input 89737): a metadata value's length set to ~240 MB over a sparse file took
    # 1-7 s (the one-shot decode copied all of it before finding the invalid byte 4.7 KB in).
    src = _llama_header(tmp_path / "src.gguf")
    data = bytearray(src.read_bytes())
    value_at = data.index(b"general.architecture") + len(b"general.architecture") + 4
    struct.pack_into("<Q", data, value_at, 150_000_000)
    data[value_at + 8 + 2] = 0xFF  # invalid UTF-8 early in the claimed string
    path = tmp_path / "value.gguf"
    path.write_bytes(bytes(data))
    os.truncate(path, 200_000_000)
    t0 = time.process_time()
    with pytest.raises(GGUFError, match="value of 'general.architecture' is not valid UTF-8"):
        GGUFFile(path)
    assert time.process_time() - t0 < 0.1


def test_long_string_values_decode_across_chunks(tmp_path):
    import gguf

    text = "é🙂x" * 700_000  # 4.9 MB of UTF-8: multi-byte characters straddle the decoder's 1 MiB chunks
    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "llama")
    w.add_string("test.long", text)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(tmp_path / "long.gguf") as g:
        assert g.metadata["test.long"] == text

"""engine.gguf_file: agreement with gguf.GGUFReader on the real models, and clear errors on bad files."""

from __future__ import annotations

import random
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.gguf_file import GGUFError, GGUFFile, TensorInfo
from tests.reference import open_gguf

MODELS = Path("/root/.cache/rqllm/models")
DEFAULT_PATHS = {
    "smollm2_path": MODELS / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3_path": MODELS / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf",
}


def model_path(request: pytest.FixtureRequest, name: str) -> Path:
    """The session fixture from tests/conftest.py when it exists, else the default cache path (skip if absent)."""
    try:
        return Path(request.getfixturevalue(name))
    except pytest.FixtureLookupError:
        pass
    p = DEFAULT_PATHS[name]
    if not p.exists():
        pytest.skip(f"model file {p} is not present (fetch it with engine.registry)")
    return p


@pytest.fixture(scope="module")
def smollm2(request) -> Path:
    return model_path(request, "smollm2_path")


@pytest.fixture(scope="module")
def gemma3(request) -> Path:
    return model_path(request, "gemma3_path")


@pytest.fixture(params=["smollm2", "gemma3"])
def model(request) -> Path:
    return request.getfixturevalue(request.param)


# --------------------------------------------------------------------------- real models


def test_matches_gguf_reader(model: Path):
    g = GGUFFile(model)
    r = open_gguf(model)  # gguf's GGUFReader, its metadata reads sped up (tests.reference)
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert list(g.metadata) == keys
    for k in keys:
        ref = r.fields[k].contents()
        v = g.metadata[k]
        if isinstance(v, np.ndarray):
            assert np.array_equal(v, np.asarray(ref, dtype=v.dtype)), k
        else:
            assert type(v) is type(ref) and v == ref, k
    assert g.data_offset == r.data_offset
    assert g.alignment == r.alignment
    assert [t.name for t in r.tensors] == list(g.tensors)
    for t in r.tensors:
        ti = g.tensors[t.name]
        assert ti == TensorInfo(t.name, tuple(int(x) for x in t.shape), int(t.tensor_type), t.data_offset, t.n_bytes)
    # spot-check the data views are the same bytes and zero-copy
    for t in r.tensors[:3] + r.tensors[-3:]:
        d = g.tensor_data(t.name)
        assert d.dtype == np.uint8 and d.shape == (t.n_bytes,)
        assert not d.flags.owndata and not d.flags.writeable
        assert np.array_equal(d, np.asarray(t.data).reshape(-1).view(np.uint8))
    g.close()


def test_known_facts(smollm2: Path, gemma3: Path):
    with GGUFFile(smollm2) as g:
        assert g.version == 3 and g.arch == "llama"
        assert g.get("llama.block_count") == 30
        assert g.get("tokenizer.ggml.model") == "gpt2" and g.get("tokenizer.ggml.pre") == "smollm"
        assert len(g.metadata["tokenizer.ggml.merges"]) == 48900
        assert g.metadata["tokenizer.ggml.tokens"][1] == "<|im_start|>"
        assert g.get("missing.key", 7) == 7
        assert "output.weight" not in g.tensors
        assert g.tensors["token_embd.weight"].type == gguf.GGMLQuantizationType.Q8_0
        assert g.tensors["token_embd.weight"].shape == (576, 49152)
    with GGUFFile(gemma3) as g:
        assert g.arch == "gemma3"
        tt = g.metadata["tokenizer.ggml.token_type"]
        sc = g.metadata["tokenizer.ggml.scores"]
        assert isinstance(tt, np.ndarray) and tt.dtype == np.int32 and len(tt) == 262144
        assert isinstance(sc, np.ndarray) and sc.dtype == np.float32
        assert g.metadata["tokenizer.ggml.tokens"][:3] == ["<pad>", "<eos>", "<bos>"]
        assert g.get("tokenizer.ggml.add_bos_token") is True


def test_open_is_fast(model: Path):
    GGUFFile(model).close()  # warm the page cache
    t = time.perf_counter()
    g = GGUFFile(model)
    elapsed = time.perf_counter() - t
    g.close()
    assert elapsed < 1.0, f"opening {model.name} took {elapsed:.3f}s"


def test_string_arrays_are_lazy(smollm2: Path):
    with GGUFFile(smollm2) as g:
        assert not isinstance(g._raw["tokenizer.ggml.tokens"], list)
        toks = g.metadata["tokenizer.ggml.tokens"]
        assert isinstance(toks, list) and g.metadata["tokenizer.ggml.tokens"] is toks


def test_tensor_view_survives_close(smollm2: Path):
    g = GGUFFile(smollm2)
    d = g.tensor_data("output_norm.weight")
    before = d.copy()
    g.close()
    assert np.array_equal(d, before)  # mapping stays alive while views exist
    with pytest.raises(GGUFError, match="closed"):
        g.tensor_data("output_norm.weight")


# --------------------------------------------------------------------------- synthetic files


def _write(path: Path, tensors=None, kv=None, alignment=None) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint32("test.u32", 7)
    w.add_int8("test.i8", -3)
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.flag", True)
    w.add_string("test.name", "héllo ✓")
    w.add_array("test.strings", ["a", "", "日本語", "🙂", "x" * 300])
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.floats", [0.5, -1.25])
    for k, v in (kv or {}).items():
        w.add_key_value(k, v[0], v[1])
    if tensors is None:
        tensors = {
            "a": np.arange(64, dtype=np.float32).reshape(2, 32),
            "b": np.ones(32, dtype=np.float16),
            "q": (np.zeros(2 * 18, dtype=np.uint8).reshape(2, 18), gguf.GGMLQuantizationType.Q4_0),
        }
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_SMALL_PATH: list[Path] = []


@pytest.fixture
def small(tmp_path) -> Path:
    p = _write(tmp_path / "small.gguf")
    _SMALL_PATH[:] = [p]
    return p


def test_synthetic_roundtrip(small: Path):
    with GGUFFile(small) as g:
        m = g.metadata
        assert m["test.u32"] == 7 and m["test.i8"] == -3 and m["test.f32"] == 1.5 and m["test.flag"] is True
        assert m["test.name"] == "héllo ✓"
        assert m["test.strings"] == ["a", "", "日本語", "🙂", "x" * 300]
        assert m["test.ints"].tolist() == [1, 2, 3]
        assert m["test.floats"].tolist() == [0.5, -1.25]
        assert g.tensors["a"].shape == (32, 2) and g.tensors["a"].nbytes == 256
        assert g.tensors["q"].shape == (32, 2) and g.tensors["q"].nbytes == 36
        assert np.array_equal(g.tensor_data("a").view(np.float32), np.arange(64, dtype=np.float32))
        assert all(t.offset % g.alignment == 0 for t in g.tensors.values())


def test_custom_alignment(tmp_path):
    with GGUFFile(_write(tmp_path / "al.gguf", alignment=64)) as g:
        assert g.alignment == 64 and g.data_offset % 64 == 0


def _header_end(path: Path) -> int:
    with GGUFFile(path) as g:
        return g.data_offset


def test_truncated_everywhere(small: Path, tmp_path):
    data = small.read_bytes()
    bad = tmp_path / "trunc.gguf"
    end = _header_end(small)
    with GGUFFile(small) as g:
        data_end = max(t.offset + t.nbytes for t in g.tensors.values())
    # (the padding after the last tensor may be cut: such a file is still valid)
    cuts = list(range(0, end + 1)) + list(range(end + 1, data_end, 7)) + [data_end - 1]
    for cut in cuts:
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError) as ei:
            GGUFFile(bad)
        msg = str(ei.value)
        assert str(bad) in msg, msg
        if cut < 24:
            assert "shorter than a GGUF header" in msg
        elif cut > end:
            assert "past the end of the file" in msg and "tensor" in msg, msg


def test_truncated_real_model(smollm2: Path, tmp_path):
    with GGUFFile(smollm2) as g:
        end = g.data_offset
    data = smollm2.read_bytes()[: end + 4096]
    bad = tmp_path / "t.gguf"
    rng = random.Random(0)
    for cut in sorted(rng.sample(range(24, end + 4096), 60)) + [end, end + 1, end + 4096]:
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="past the end|absurd"):
            GGUFFile(bad)


def test_wrong_magic(small: Path, tmp_path):
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + small.read_bytes()[4:])
    with pytest.raises(GGUFError, match=r"not a GGUF file.*GGML"):
        GGUFFile(bad)


@pytest.mark.parametrize("version,pattern", [(1, "unsupported GGUF version 1"), (4, "unsupported GGUF version 4"),
                                             (0x03000000, "big-endian")])
def test_bad_version(small: Path, tmp_path, version, pattern):
    data = bytearray(small.read_bytes())
    struct.pack_into("<I", data, 4, version)
    bad = tmp_path / "v.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=pattern):
        GGUFFile(bad)


def test_version_2_accepted(small: Path, tmp_path):
    data = bytearray(small.read_bytes())
    struct.pack_into("<I", data, 4, 2)
    p = tmp_path / "v2.gguf"
    p.write_bytes(bytes(data))
    with GGUFFile(p) as g:
        assert g.version == 2


@pytest.mark.parametrize("offset,what", [(8, "tensor count"), (16, "metadata count")])
def test_absurd_counts(small: Path, tmp_path, offset, what):
    data = bytearray(small.read_bytes())
    struct.pack_into("<Q", data, offset, 1 << 60)
    bad = tmp_path / "c.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=what + ".*absurd"):
        GGUFFile(bad)


def _find(data: bytes, needle: bytes) -> int:
    i = data.find(needle)
    assert i >= 0
    return i


def test_unknown_value_type(small: Path, tmp_path):
    data = bytearray(small.read_bytes())
    i = _find(data, b"test.u32") + len(b"test.u32")
    struct.pack_into("<I", data, i, 77)
    bad = tmp_path / "vt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"'test.u32' has unknown value type 77 at offset"):
        GGUFFile(bad)


def test_string_array_length_past_end(small: Path, tmp_path):
    data = bytearray(small.read_bytes())
    i = _find(data, b"test.strings") + len(b"test.strings") + 4 + 4  # value type, item type
    struct.pack_into("<Q", data, i, 1 << 40)
    bad = tmp_path / "sa.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="string array 'test.strings'"):
        GGUFFile(bad)
    # an item length running past the end
    data = bytearray(small.read_bytes())
    struct.pack_into("<Q", data, i + 8, 1 << 40)
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="test.strings.*past the end"):
        GGUFFile(bad)


def _tensor_entry(data: bytes, name: bytes) -> int:
    """Offset of the n_dims field of the tensor-info entry for `name`."""
    with GGUFFile(_SMALL_PATH[0]) as g:
        end = g.data_offset
    i = data.rfind(struct.pack("<Q", len(name)) + name, 0, end)  # tensor infos come after the metadata
    assert i >= 0
    return i + 8 + len(name)


def test_unknown_tensor_type(small: Path, tmp_path):
    data = bytearray(small.read_bytes())
    i = _tensor_entry(data, b"b")
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<I", data, i + 4 + 8 * n_dims, 4)  # 4 was Q4_2, removed from ggml
    bad = tmp_path / "tt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor 'b' has unknown ggml type id 4"):
        GGUFFile(bad)


def test_too_many_dims(small: Path, tmp_path):
    data = bytearray(small.read_bytes())
    struct.pack_into("<I", data, _tensor_entry(data, b"a"), 5)
    bad = tmp_path / "nd.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor 'a' has 5 dimensions"):
        GGUFFile(bad)


def test_block_size_mismatch(small: Path, tmp_path):
    data = bytearray(small.read_bytes())
    i = _tensor_entry(data, b"q")
    struct.pack_into("<Q", data, i + 4, 16)  # ne0 16 for a 32-element Q4_0 block
    bad = tmp_path / "bs.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"'q' \(Q4_0\) has ne0=16, not a multiple of the block size 32"):
        GGUFFile(bad)


def _set_tensor_offset(data: bytearray, name: bytes, rel: int) -> None:
    i = _tensor_entry(data, name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<Q", data, i + 4 + 8 * n_dims + 4, rel)


def test_misaligned_overlapping_out_of_bounds(small: Path, tmp_path):
    bad = tmp_path / "off.gguf"
    for rel, pattern in [(3, "not aligned to 32"), (0, "overlaps"), (1 << 40, "past the end")]:
        data = bytearray(small.read_bytes())
        _set_tensor_offset(data, b"b", rel)
        bad.write_bytes(bytes(data))
        with pytest.raises(GGUFError, match=pattern):
            GGUFFile(bad)


def test_duplicate_tensor_name(small: Path, tmp_path):
    data = bytearray(small.read_bytes())
    i = _tensor_entry(data, b"b")
    data[i - 1 : i] = b"a"
    bad = tmp_path / "dup.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="duplicate tensor name 'a'"):
        GGUFFile(bad)


def test_invalid_utf8_key(small: Path, tmp_path):
    data = bytearray(small.read_bytes())
    i = _find(data, b"test.name")
    data[i] = 0xFF
    bad = tmp_path / "u.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="not valid UTF-8"):
        GGUFFile(bad)


def test_invalid_utf8_in_string_array_reported_on_access(small: Path, tmp_path):
    data = bytearray(small.read_bytes())
    i = _find(data, "日本語".encode())
    data[i] = 0xFF
    bad = tmp_path / "u2.gguf"
    bad.write_bytes(bytes(data))
    with GGUFFile(bad) as g:
        with pytest.raises(GGUFError, match=r"'test.strings' item 2 .*not valid UTF-8"):
            g.metadata["test.strings"]


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "nope.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="0 bytes, shorter than a GGUF header"):
        GGUFFile(tmp_path / "empty.gguf")


def test_random_corruption_never_crashes(small: Path, tmp_path):
    """Flip random header bytes: the reader either parses or raises GGUFError, nothing else."""
    data = small.read_bytes()
    end = _header_end(small)
    bad = tmp_path / "fuzz.gguf"
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(400):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(end)] = rng.randrange(256)
        bad.write_bytes(bytes(b))
        try:
            with GGUFFile(bad) as g:
                for k in g.metadata:
                    g.metadata[k]
            outcomes["ok"] += 1
        except GGUFError as e:
            assert "malformed GGUF" not in str(e), f"an unchecked path reached the safety net: {e}"
            outcomes["error"] += 1
    assert outcomes["error"] > 0

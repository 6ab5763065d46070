"""bench/shape_8b.py at toy size: the file's header says what the recipe promises (types, shapes,
tokenizer copied from SmolLM2, small positive scales) and our engine runs it to finite logits that
agree with the numpy reference.  (The 4.5 GB file itself is made by `python bench/shape_8b.py`.)"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine.gguf_file import GGUFFile
from engine.model import Model

from tests.bench_module import load_bench_module

shape_8b = load_bench_module("shape_8b")

# What the tiny recipe must produce, written out here rather than taken from the generator:
# hidden 256, FFN 512, 4 heads of 64 -> q 256 wide, 2 KV heads -> k/v 128 wide, vocab 49152.
EXPECTED_LAYER = {  # suffix -> (GGUF shape (ne0 first), type in even layers, type in odd layers)
    "attn_norm.weight": ((256,), T.F32, T.F32),
    "attn_q.weight": ((256, 256), T.Q4_K, T.Q4_K),
    "attn_k.weight": ((256, 128), T.Q4_K, T.Q4_K),
    "attn_v.weight": ((256, 128), T.Q6_K, T.Q4_K),
    "attn_output.weight": ((256, 256), T.Q4_K, T.Q4_K),
    "ffn_norm.weight": ((256,), T.F32, T.F32),
    "ffn_gate.weight": ((256, 512), T.Q4_K, T.Q4_K),
    "ffn_up.weight": ((256, 512), T.Q4_K, T.Q4_K),
    "ffn_down.weight": ((512, 256), T.Q6_K, T.Q4_K),
}
EXPECTED_GLOBAL = {
    "token_embd.weight": ((256, 49152), T.Q4_K),
    "output_norm.weight": ((256,), T.F32),
    "output.weight": ((256, 49152), T.Q6_K),
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_path) -> Path:
    return shape_8b.generate(tmp_path_factory.mktemp("shape8b") / "tiny.gguf", shape_8b.TINY,
                             tokenizer_src=smollm2_path)


def test_header_types_shapes_and_metadata(tiny_path, smollm2_path):
    expected = dict(EXPECTED_GLOBAL)
    for il in range(2):
        for suffix, (shape, even, odd) in EXPECTED_LAYER.items():
            expected[f"blk.{il}.{suffix}"] = (shape, even if il % 2 == 0 else odd)
    with GGUFFile(tiny_path) as f, GGUFFile(smollm2_path) as src:
        got = {name: (tuple(info.shape), T(info.type)) for name, info in f.tensors.items()}
        assert got == expected
        assert f.arch == "llama"
        assert (f.get("llama.block_count"), f.get("llama.embedding_length"), f.get("llama.feed_forward_length"),
                f.get("llama.attention.head_count"), f.get("llama.attention.head_count_kv")) == (2, 256, 512, 4, 2)
        assert f.get("llama.rope.freq_base") == 500000.0
        assert f.get("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
        assert f.get("llama.context_length") == 8192
        src_tok = sorted(k for k in src.metadata if k.startswith("tokenizer."))
        assert sorted(k for k in f.metadata if k.startswith("tokenizer.")) == src_tok
        for key in src_tok:
            a, b = f.get(key), src.get(key)
            assert f.metadata.value_type(key) == src.metadata.value_type(key), key
            if isinstance(a, np.ndarray):
                assert np.array_equal(a, b), key
            else:
                assert a == b, key
        # Every f16 super-block scale is a small positive number (no NaN/Inf can come out).
        for name, info in f.tensors.items():
            data = f.tensor_data(name)
            if info.type == T.Q4_K:
                blocks = data.reshape(-1, 144)
                scales = np.concatenate([blocks[:, 0:2], blocks[:, 2:4]]).copy().view(np.float16)
            elif info.type == T.Q6_K:
                scales = data.reshape(-1, 210)[:, 208:210].copy().view(np.float16)
            else:
                norms = data.view(np.float32)
                assert np.all(np.abs(norms - 1) < 0.2), name
                continue
            assert np.all((scales >= 9e-4) & (scales <= 1.1e-2)), name
            assert len(np.unique(scales)) > 10, name  # random, not one constant


def test_engine_runs_it_to_finite_logits_matching_the_reference(tiny_path):
    from tests.reference import ReferenceModel

    toks = [1, 200, 3000, 45000, 17, 9]
    model = Model.load(tiny_path, threads=2, kv_budget="16MiB")
    ours = model.forward_all(toks, 0)
    ref = ReferenceModel(tiny_path).forward(toks)
    assert np.isfinite(ours).all()
    assert ours.std() > 1.0  # random weights give large, varied logits, not zeros
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 0.05, rel


def test_is_complete_rejects_a_truncated_file(tiny_path, tmp_path):
    assert shape_8b.is_complete(tiny_path, shape_8b.TINY)
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(tiny_path, cut)
    with cut.open("r+b") as fh:
        fh.truncate(cut.stat().st_size - 1000)
    assert not shape_8b.is_complete(cut, shape_8b.TINY)
    assert not shape_8b.is_complete(tiny_path, shape_8b.LLAMA3_8B)  # a different shape is not the cached model

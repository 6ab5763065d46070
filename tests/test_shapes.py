"""bench/shapes.py at toy size: each named shape's file header says what its recipe promises
(types, shapes, tokenizer copied from SmolLM2, padded vocabulary, small positive scales) and our
engine runs it to finite logits that agree with the numpy reference.  (The full files are made
by `python -m bench.shapes 8b-shape` / `1.5b-shape`.)"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from engine.gguf_file import GGUFFile
from engine.model import Model

from bench import shapes
from bench import shape_8b  # the old entry point, a wrapper over shapes

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

# The tiny qwen2 recipe: same sizes, 2 layers, q/k/v biases, tied output (token_embd Q6_K, no
# output.weight), Q6_K attn_v / ffn_down where llama.cpp's use_more_bits(i, 2) holds (layer 1 only),
# vocabulary padded from 49152 to 50000.
QWEN2_VOCAB = 50000
EXPECTED_QWEN2_LAYER = {  # suffix -> (GGUF shape, type in layer 0, type in layer 1)
    "attn_norm.weight": ((256,), T.F32, T.F32),
    "attn_q.weight": ((256, 256), T.Q4_K, T.Q4_K),
    "attn_q.bias": ((256,), T.F32, T.F32),
    "attn_k.weight": ((256, 128), T.Q4_K, T.Q4_K),
    "attn_k.bias": ((128,), T.F32, T.F32),
    "attn_v.weight": ((256, 128), T.Q4_K, T.Q6_K),
    "attn_v.bias": ((128,), T.F32, T.F32),
    "attn_output.weight": ((256, 256), T.Q4_K, T.Q4_K),
    "ffn_norm.weight": ((256,), T.F32, T.F32),
    "ffn_gate.weight": ((256, 512), T.Q4_K, T.Q4_K),
    "ffn_up.weight": ((256, 512), T.Q4_K, T.Q4_K),
    "ffn_down.weight": ((512, 256), T.Q4_K, T.Q6_K),
}
EXPECTED_QWEN2_GLOBAL = {
    "token_embd.weight": ((256, QWEN2_VOCAB), T.Q6_K),
    "output_norm.weight": ((256,), T.F32),
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_path) -> Path:
    return shape_8b.generate(tmp_path_factory.mktemp("shape8b") / "tiny.gguf", shape_8b.TINY,
                             tokenizer_src=smollm2_path)


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory, smollm2_path) -> Path:
    return shapes.SHAPES["1.5b-shape"].generate(tmp_path_factory.mktemp("shape1_5b") / "tiny.gguf", tiny=True,
                                                tokenizer_src=smollm2_path)


def _block_scales(data: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.Q4_K:
        blocks = data.reshape(-1, 144)
        return np.concatenate([blocks[:, 0:2], blocks[:, 2:4]]).copy().view(np.float16)
    assert qtype == T.Q6_K
    return data.reshape(-1, 210)[:, 208:210].copy().view(np.float16)


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
        assert f.get("rqllm.bench.shape_8b.recipe") == 1  # the key a cached 8b file is recognised by
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
            if info.type == T.F32:
                norms = data.view(np.float32)
                assert np.all(np.abs(norms - 1) < 0.2), name
                continue
            scales = _block_scales(data, T(info.type))
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


def test_8b_shape_keeps_its_cache_name_and_bytes(tiny_path, tmp_path, smollm2_path):
    """The 8b recipe through shapes.py writes what shape_8b.py wrote, under the same file name."""
    r = shapes.SHAPES["8b-shape"]
    assert r.default_path().name == shape_8b.FILENAME == "8b-shape-q4_k_m.gguf"
    again = r.generate(tmp_path / "again.gguf", tiny=True, tokenizer_src=smollm2_path)
    assert again.read_bytes() == tiny_path.read_bytes()
    assert not shapes.SHAPES["1.5b-shape"].is_complete(tiny_path, shapes.TINY_QWEN2)


# --------------------------------------------------------------------------------- 1.5b-shape


def test_use_more_bits_is_llama_cpps_rule():
    """Q4_K_M's Q6_K layers of a 28-layer model, as llama.cpp's src/llama-quant.cpp picks them."""
    assert [i for i in range(28) if shapes.use_more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert [i for i in range(32) if shapes.use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29,
                                                                     30, 31]


def test_full_1_5b_plan_has_qwen25_shapes_and_about_a_gigabyte():
    plan = {t.name: t for t in shapes.tensor_plan(shapes.QWEN25_1_5B, shapes.QWEN25_1_5B.n_vocab)}
    assert (plan["token_embd.weight"].shape, plan["token_embd.weight"].type) == ((1536, 151936), T.Q6_K)
    assert "output.weight" not in plan
    assert plan["blk.27.attn_q.weight"].shape == (1536, 1536)
    assert plan["blk.27.attn_k.weight"].shape == (1536, 256)
    assert plan["blk.27.attn_k.bias"].shape == (256,)
    assert plan["blk.0.ffn_down.weight"].shape == (8960, 1536)
    assert len([n for n in plan if n.startswith("blk.") and n.endswith(".bias")]) == 28 * 3
    q6 = sorted({int(n.split(".")[1]) for n, t in plan.items() if n.startswith("blk.") and t.type == T.Q6_K})
    assert q6 == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    for il in q6:
        assert plan[f"blk.{il}.attn_v.weight"].type == plan[f"blk.{il}.ffn_down.weight"].type == T.Q6_K
        assert plan[f"blk.{il}.ffn_up.weight"].type == T.Q4_K
    total = sum(t.nbytes for t in plan.values())
    assert 0.9e9 < total < 1.1e9, total


def test_qwen2_header_types_shapes_and_padded_vocabulary(qwen2_path, smollm2_path):
    expected = dict(EXPECTED_QWEN2_GLOBAL)
    for il in range(2):
        for suffix, (shape, first, second) in EXPECTED_QWEN2_LAYER.items():
            expected[f"blk.{il}.{suffix}"] = (shape, first if il == 0 else second)
    with GGUFFile(qwen2_path) as f, GGUFFile(smollm2_path) as src:
        got = {name: (tuple(info.shape), T(info.type)) for name, info in f.tensors.items()}
        assert got == expected
        assert f.arch == "qwen2"
        assert (f.get("qwen2.block_count"), f.get("qwen2.embedding_length"), f.get("qwen2.feed_forward_length"),
                f.get("qwen2.attention.head_count"), f.get("qwen2.attention.head_count_kv")) == (2, 256, 512, 4, 2)
        assert f.get("qwen2.rope.freq_base") == 1000000.0
        assert f.get("qwen2.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
        assert f.get("qwen2.context_length") == 32768
        assert f.get("qwen2.vocab_size") == QWEN2_VOCAB
        assert f.get("rqllm.bench.shape_1_5b.recipe") == 1
        src_tok = sorted(k for k in src.metadata if k.startswith("tokenizer."))
        assert sorted(k for k in f.metadata if k.startswith("tokenizer.")) == src_tok
        n_src = len(src.get("tokenizer.ggml.tokens"))
        for key in src_tok:
            a, b = f.get(key), src.get(key)
            assert f.metadata.value_type(key) == src.metadata.value_type(key), key
            if key == "tokenizer.ggml.tokens":
                assert a[:n_src] == b
                assert a[n_src:] == [f"<|rqllm_pad_{i}|>" for i in range(n_src, QWEN2_VOCAB)]
            elif key == "tokenizer.ggml.token_type":
                assert np.array_equal(a[:n_src], b) and len(a) == QWEN2_VOCAB
                assert np.all(a[n_src:] == 5)  # LLAMA_TOKEN_TYPE_UNUSED
            elif isinstance(a, np.ndarray):
                assert np.array_equal(a, b), key
            else:
                assert a == b, key
        for name, info in f.tensors.items():
            data = f.tensor_data(name)
            if info.type == T.F32:
                values = data.view(np.float32)
                if name.endswith(".bias"):
                    assert np.all(np.abs(values) < 0.6) and values.std() > 0.05, name
                else:
                    assert np.all(np.abs(values - 1) < 0.2), name
                continue
            scales = _block_scales(data, T(info.type))
            assert np.all((scales >= 9e-5) & (scales <= 1.1e-3)), name
            assert len(np.unique(scales)) > 10, name


def test_qwen2_engine_and_tokenizer_load_it_and_logits_match_the_reference(qwen2_path):
    """Our logits (pad-token ids included) match the reference, and are far from a reference
    without the biases or with adjacent-pair RoPE: the biases and NEOX RoPE are really exercised."""
    from engine.tokenizer import Tokenizer
    from tests import reference as R

    def rel(a, b) -> float:
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    toks = [1, 200, 3000, 45000, 17, 9, 300, 400, 49152, 49999, 5000, 6000, 7000, 800, 900, 1000] * 2
    model = Model.load(qwen2_path, threads=1, kv_budget="16MiB")
    assert model.cfg.arch == "qwen2" and model.cfg.n_vocab == QWEN2_VOCAB and model.weights.tied_output
    assert all({"bq", "bk", "bv"} <= set(layer) for layer in model.weights.layers)
    ours = model.forward_all(toks, 0)
    assert ours.shape == (len(toks), QWEN2_VOCAB) and np.isfinite(ours).all()
    assert ours.std() > 0.5
    with R.blas_threads(1):
        ref = R.ReferenceModel(qwen2_path)
        theirs = ref.forward(toks)
        close = rel(ours, theirs)
        assert close < 0.03, close
        assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 0.05
        no_bias = copy.copy(ref)
        no_bias._layers = {False: [{k: (np.zeros_like(v) if k.endswith("_bias") else v) for k, v in layer.items()}
                                   for layer in ref.layers], True: None}
        assert rel(ours, no_bias.forward(toks)) > 5 * close + 0.05
        assert rel(ours, ref.variant(rope_neox=False).forward(toks)) > 3 * close + 0.02

    tok = Tokenizer.from_gguf(qwen2_path, use_cache=False)
    assert tok.vocab_size == QWEN2_VOCAB
    assert tok.token_type(49999) == 5 and tok.token_text(49999) == "<|rqllm_pad_49999|>"
    assert tok.decode(tok.encode("Hello world", add_bos=False)) == "Hello world"


def test_qwen2_is_complete(qwen2_path, tmp_path):
    r = shapes.SHAPES["1.5b-shape"]
    assert r.is_complete(qwen2_path, shapes.TINY_QWEN2)
    assert not r.is_complete(qwen2_path)  # the tiny file is not the cached 1.5b model
    assert not shapes.SHAPES["8b-shape"].is_complete(qwen2_path, shapes.TINY)
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(qwen2_path, cut)
    with cut.open("r+b") as fh:
        fh.truncate(cut.stat().st_size - 1000)
    assert not r.is_complete(cut, shapes.TINY_QWEN2)


def test_cli_names_and_tiny(tmp_path, smollm2_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        shapes.main(["--list"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "8b-shape" in out and "1.5b-shape" in out
    with pytest.raises(SystemExit) as e:
        shapes.main(["70b-shape"])
    assert e.value.code == 2
    monkeypatch.setattr(shapes.registry, "resolve", lambda name: smollm2_path)
    with pytest.raises(SystemExit) as e:
        shapes.main(["1.5b-shape", "--tiny", "-o", str(tmp_path / "t.gguf")])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "t.gguf")
    assert shapes.SHAPES["1.5b-shape"].is_complete(tmp_path / "t.gguf", shapes.TINY_QWEN2)

"""No silent wrong answers: a GGUF with a tensor the forward pass would not use, or a metadata key
that changes the math and that we do not implement, is refused at load with one line naming it.

Each case rewrites a small valid model (bench/shapes.py's tiny Llama 3.2 recipe: llama arch with
rope_freqs.weight) with one change, and checks the message. The unchanged file loads (so each
refusal is the change's doing)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from engine.model import Model, ModelError

from bench import shapes


@pytest.fixture(scope="module")
def base(tmp_path_factory, smollm2_path) -> Path:
    folder = tmp_path_factory.mktemp("refusals")
    made = shapes.SHAPES["llama3.2-3b-shape"].generate(folder / "made.gguf", tiny=True, tokenizer_src=smollm2_path)
    return rewrite(made, folder / "base.gguf")  # without the tokenizer: the rewrites below read it quickly


def rewrite(src: Path, dst: Path, *, arch: str | None = None, keys: dict | None = None,
            tensors: dict[str, np.ndarray] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """src with metadata keys set ({name: (value, GGUFValueType)}), F32 tensors added, tensors dropped,
    and optionally another architecture name (its `{arch}.` keys renamed along). The tokenizer is left
    out (loading a model does not read it; copying its 49,152 tokens took most of the time)."""
    reader = GGUFReader(str(src))
    old_arch = reader.fields["general.architecture"].contents()
    arch = arch or old_arch
    writer = GGUFWriter(str(dst), arch)
    keys = dict(keys or {})
    for name, f in reader.fields.items():
        if name.startswith(("GGUF.", "tokenizer.")) or name == "general.architecture":
            continue
        new_name = arch + name[len(old_arch):] if name.startswith(old_arch + ".") else name
        if new_name in keys:
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(new_name, f.contents(), vtype, sub_type=sub)
    for name, (value, vtype) in keys.items():
        writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name not in drop:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, data in (tensors or {}).items():
        writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def load(path: Path) -> Model:
    return Model.load(str(path), threads=1, kv_budget="4MiB", repack=False)


def test_the_unchanged_file_loads(base):
    assert load(base).cfg.arch == "llama"


F = GGUFValueType.FLOAT32
S = GGUFValueType.STRING
U = GGUFValueType.UINT32

CASES = {
    "an unused tensor (a reranker head)": (
        dict(tensors={"cls.output.weight": np.ones(256)}),
        "tensor cls.output.weight is not used by the llama forward pass"),
    "an unused layer tensor": (
        dict(tensors={"blk.0.attn_output.bias": np.zeros(256)}),
        "tensor blk.0.attn_output.bias is not used by the llama forward pass"),
    "an unknown rope scaling type": (
        dict(keys={"llama.rope.scaling.type": ("su", S)}),
        "llama.rope.scaling.type = 'su' is not implemented"),
    "soft-capping on an architecture without it": (
        dict(keys={"llama.attn_logit_softcapping": (50.0, F)}),
        "metadata key llama.attn_logit_softcapping is not implemented for llama"),
    "an attention scale override": (
        dict(keys={"llama.attention.scale": (0.5, F)}),
        "metadata key llama.attention.scale is not implemented for llama"),
    "experts named without their tensors": (
        dict(keys={"llama.expert_count": (8, U), "llama.expert_used_count": (2, U)}),
        "tensor blk.0.ffn_gate_inp.weight is missing (needed by llama)"),
    "experts on an architecture without a mixture-of-experts form": (
        dict(arch="qwen2", keys={"qwen2.expert_count": (8, U), "qwen2.expert_used_count": (2, U)}),
        "qwen2.expert_count = 8: qwen2 has no mixture-of-experts form"),
    "more experts per token than experts": (
        dict(keys={"llama.expert_count": (8, U), "llama.expert_used_count": (9, U)}),
        "llama.expert_used_count = 9: need 0 < used <= count"),
    "an expert weights scale": (
        dict(keys={"llama.expert_weights_scale": (2.5, F)}),
        "metadata key llama.expert_weights_scale is not implemented for llama"),
    "a value length unlike the key length": (
        dict(keys={"llama.attention.value_length": (32, U)}),
        "llama.attention.value_length = 32 differs from key_length 64"),
    "an attention factor without YaRN or LongRoPE": (
        dict(keys={"llama.rope.scaling.attn_factor": (1.2, F)}),
        "llama.rope.scaling.attn_factor = 1.2"),
    "rope factors of the wrong length": (
        dict(drop=("rope_freqs.weight",), tensors={"rope_freqs.weight": np.ones(16)}),
        "tensor rope_freqs.weight has shape [16]"),
    "rope factors that are not positive": (
        dict(drop=("rope_freqs.weight",), tensors={"rope_freqs.weight": np.zeros(32)}),
        "the RoPE factors must be positive and finite"),
    "half of LongRoPE's pair": (
        dict(drop=("rope_freqs.weight",), tensors={"rope_factors_long.weight": np.ones(32)}),
        "rope_factors_long.weight and rope_factors_short.weight come as a pair"),
    "LongRoPE named without its factor tensors": (
        dict(keys={"llama.rope.scaling.type": ("longrope", S)}),
        "llama.rope.scaling.type = 'longrope' is not implemented"),
    "qwen3 without its QK norms": (
        dict(arch="qwen3"),
        "tensor blk.0.attn_q_norm.weight is missing (needed by qwen3)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_with_one_line_naming_it(base, tmp_path, case):
    change, message = CASES[case]
    path = rewrite(base, tmp_path / "changed.gguf", **change)
    with pytest.raises(ModelError) as info:
        load(path)
    text = str(info.value)
    assert message in text
    assert "\n" not in text and text.startswith(str(path))


def test_harmless_keys_and_tensors_are_accepted(base, tmp_path):
    """Keys and tensors in the tables of harmless ones (a dense model's expert_count 0,
    rope.scaling.finetuned, an old converter's attn_rot_embd) load, and give the same logits as
    without them."""
    path = rewrite(base, tmp_path / "harmless.gguf",
                   keys={"llama.expert_count": (0, U), "llama.rope.scaling.finetuned": (True, GGUFValueType.BOOL)},
                   tensors={"blk.0.attn_rot_embd": np.ones(32)})
    ids = [1, 200, 3000, 42]
    np.testing.assert_array_equal(load(path).forward_all(ids), load(base).forward_all(ids))

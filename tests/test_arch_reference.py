"""The numpy reference (tests/reference.py) on eight architecture variants, against llama.cpp.

The models are tiny random-weight GGUFs (tests/arch_models.py: Llama 3 rope_freqs + linear
scaling, YaRN, qwen3, gemma2, phi3 LongRoPE, and the mixtures of experts qwen3moe, mixtral, olmoe); llama.cpp's logits on one 48-token sequence are
fixtures (tests/tools/make_arch_fixtures.py, n_ctx 512).  For each architecture:

* the reference agrees with llama.cpp: cosine >= MIN_COS between the two logit vectors (over the
  fixture's vocab_ids: 4096 random ids and every position's top 16) at every position, and the
  same top-1 (over the full vocabulary) at >= MIN_TOP1 of the positions;
* each feature matters: the reference with that feature switched off (rope factors all 1, no
  soft-cap, no sliding window, short instead of long factors, no QK norm, ...) does not reach
  that agreement, so the agreement test can fail.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tests import arch_models as AM
from tests import reference as R

MIN_COS = 0.999
MIN_TOP1 = 0.90
MODES = {"f32": False, "ggml": True}


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    """Small float32 matmuls run several times faster on one OpenBLAS thread on 2 shared cores."""
    with R.blas_threads(1):
        yield


class Arch:
    """One architecture model: its file, llama.cpp's fixture, the reference (loaded once) and the
    reference's logits per variant (computed once)."""

    def __init__(self, name, path):
        self.name, self.path = name, path
        self._fx = None
        self.ref = R.ReferenceModel(path, n_ctx=R.DEFAULT_N_CTX)
        self._logits = {}

    @property
    def fx(self) -> dict:
        if self._fx is None:
            self._fx = AM.arch_fixture(self.name, self.path)  # skips when missing or stale
            assert self._fx["n_ctx"] == self.ref.config.n_ctx
        return self._fx

    def logits(self, variant: str = "as is", ggml_numerics: bool = False) -> np.ndarray:
        key = (variant, ggml_numerics)
        if key not in self._logits:
            model = self.ref if variant == "as is" else OFF[self.name][variant](self.ref)
            self._logits[key] = model.forward(self.fx["ids"].tolist(), ggml_numerics=ggml_numerics)
        return self._logits[key]

    def agreement(self, logits: np.ndarray) -> tuple[np.ndarray, float]:
        """(cosine per position over vocab_ids, top-1 agreement rate over the full vocabulary)."""
        ours, theirs = logits[:, self.fx["vocab_ids"]], self.fx["logits"]
        cos = (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
        return cos, float((logits.argmax(1) == self.fx["top1"]).mean())


@pytest.fixture(scope="module")
def archs(smollm2_path):
    """name -> Arch, each model dequantized once for the module (and dropped after it)."""
    loaded: dict[str, Arch] = {}

    def get(name: str) -> Arch:
        if name not in loaded:
            loaded[name] = Arch(name, AM.arch_model(name, smollm2_path))
        return loaded[name]

    yield get
    loaded.clear()


@pytest.fixture(scope="module", params=AM.ARCH_NAMES)
def arch(request, archs) -> Arch:
    return archs(request.param)


# ---------------------------------------------------------------------------------------------
# the variants with one feature switched off


def _swap_gate_up(ref: R.ReferenceModel) -> R.ReferenceModel:
    """phi3 with ffn_up's halves read the other way round (up first, then gate)."""
    other = R.ReferenceModel.variant(ref)
    n_ff = ref.config.n_ff
    layers = []
    for layer in ref.layers:
        w = layer["ffn_up"].w
        layers.append({**layer, "ffn_up": R.Linear(np.concatenate([w[n_ff:], w[:n_ff]]))})
    other._layers = {False: layers, True: None}  # noqa: SLF001 (f32 only)
    return other


def _qk_norm_per_head(ref: R.ReferenceModel) -> R.ReferenceModel:
    """olmoe run as qwen3moe: q/k norms per head (each head's slice of the full-width weights)."""
    other = R.ReferenceModel.variant(ref)
    other._layer_fn = R.qwen3moe_layer  # noqa: SLF001
    hd = ref.config.head_dim
    other._layers = {False: [{**L, "attn_q_norm": L["attn_q_norm"][:hd], "attn_k_norm": L["attn_k_norm"][:hd]}  # noqa: SLF001
                             for L in ref.layers], True: None}
    return other


def _factors(name):
    return lambda ref: ref.variant(rope_factors=tuple(float(v) for v in ref.weights[name]))


OFF = {
    "llama3": {
        "rope_freqs all 1": lambda ref: ref.variant(rope_factors=None),
        "no linear freq_scale": lambda ref: ref.variant(rope_freq_scale=1.0),
    },
    "llama-yarn": {
        "no YaRN ramp (linear)": lambda ref: ref.variant(rope_ext_factor=0.0),
        "no YaRN mscale": lambda ref: ref.variant(rope_attn_factor=1.0 / (1.0 + 0.1 * math.log(4.0))),
        "no rope scaling": lambda ref: ref.variant(rope_ext_factor=0.0, rope_freq_scale=1.0),
    },
    "qwen3": {
        "no QK norm": lambda ref: ref.variant(qk_norm=False),
    },
    "gemma2": {
        "no attention soft-cap": lambda ref: ref.variant(attn_softcap=None),
        "no final soft-cap": lambda ref: ref.variant(final_softcap=None),
        "no sliding window": lambda ref: ref.variant(sliding_window=None),
        "odd layers sliding": lambda ref: ref.variant(local_layers=tuple(not x for x in ref.config.local_layers)),
        "q scale 1/sqrt(n_embd/n_head)": lambda ref: ref.variant(
            attn_scale=1.0 / math.sqrt(ref.config.n_embd / ref.config.n_head)),
    },
    "qwen3moe": {
        "weights not renormalised": lambda ref: ref.variant(expert_norm=False),
        "one expert per token": lambda ref: ref.variant(n_expert_used=1, expert_norm=False),
    },
    "mixtral": {
        "weights not renormalised": lambda ref: ref.variant(expert_norm=False),
        "three experts per token": lambda ref: ref.variant(n_expert_used=3),
    },
    "olmoe": {
        "weights renormalised": lambda ref: ref.variant(expert_norm=True),
        "QK norm per head": _qk_norm_per_head,
    },
    "phi3": {
        "short instead of long factors": _factors("rope_factors_short.weight"),
        "rope factors all 1": lambda ref: ref.variant(rope_factors=None),
        "no attn_factor": lambda ref: ref.variant(rope_attn_factor=1.0),
        "gate and up halves swapped": _swap_gate_up,
    },
}
OFF_CASES = [(name, variant) for name, variants in OFF.items() for variant in variants]


# ---------------------------------------------------------------------------------------------
# building blocks (no model needed)


def test_yarn_corr_dims_and_ramp_by_hand():
    # 64 * ln(1024 / (2 pi 32)) / (2 ln 1e4) = 5.66 -> 5; 64 * ln(1024 / (2 pi)) / (2 ln 1e4) = 17.7 -> 18
    assert R.yarn_corr_dims(64, 1024, 1e4, 32.0, 1.0) == (5.0, 18.0)
    assert R.yarn_corr_dims(64, 64, 1e4, 32.0, 1.0) == (0.0, 9.0)  # a small original context: from 0
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 1, 64)).astype(np.float32)
    pos = np.array([40])
    got = R.rope(x, pos, 1e4, 64, False, freq_scale=0.25, ext_factor=1.0, corr_dims=(5.0, 18.0), mscale=1.0)
    m = 1 + 0.1 * math.log(4.0)
    for i, mix in ((2, 1.0), (10, 1 - 5 / 13), (25, 0.0)):  # before, inside, after the ramp
        t = 40 * 1e4 ** (-2 * i / 64)
        theta = 0.25 * t * (1 - mix) + t * mix
        c, s = math.cos(theta) * m, math.sin(theta) * m
        want = [x[0, 0, 2 * i] * c - x[0, 0, 2 * i + 1] * s, x[0, 0, 2 * i] * s + x[0, 0, 2 * i + 1] * c]
        np.testing.assert_allclose(got[0, 0, 2 * i: 2 * i + 2], want, rtol=1e-5)


def test_rope_factors_divide_the_angle_and_mscale_spares_unrotated_dims():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 2, 64)).astype(np.float32)
    pos = np.array([0, 7, 31])
    ones = R.rope(x, pos, 1e4, 48, True, freq_factors=np.ones(24))
    np.testing.assert_array_equal(ones, R.rope(x, pos, 1e4, 48, True))
    ff = np.linspace(1, 16, 24)
    got = R.rope(x, pos, 1e4, 48, True, freq_factors=ff, mscale=1.5)
    theta = 31 * 1e4 ** (-2 * 5 / 48) / ff[5]
    c, s = math.cos(theta) * 1.5, math.sin(theta) * 1.5
    np.testing.assert_allclose(got[2, 1, [5, 29]], [x[2, 1, 5] * c - x[2, 1, 29] * s,
                                                    x[2, 1, 5] * s + x[2, 1, 29] * c], rtol=1e-5)
    np.testing.assert_array_equal(got[..., 48:], x[..., 48:])  # partial rotary: the rest as is


def test_attention_softcap():
    q = np.ones((2, 1, 4), np.float32) * 3
    k = np.array([[[1, 1, 1, 1]], [[-1, -1, -1, -1]]], np.float32)
    v = np.array([[[1, 0, 0, 0]], [[0, 1, 0, 0]]], np.float32)
    pos = np.arange(2)
    out = R.attention(q, k, v, pos, pos, 1.0, None, softcap=2.0)
    s = 2.0 * np.tanh(np.array([12.0, -12.0]) / 2.0)  # scores +-12 capped to +-1.99
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    np.testing.assert_allclose(out[1, 0, :2], p, rtol=1e-5)


def _tiny_gguf(path, arch: str, keys: dict, tensors: dict) -> R.Config:
    """read_config of a minimal GGUF: hidden 16, 2 heads, 1 layer, vocabulary 8, plus keys/tensors."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_embedding_length(16)
    w.add_head_count(2)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_context_length(4096)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in keys.items():
        k = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(k, value)
        elif isinstance(value, float):
            w.add_float32(k, value)
        else:
            w.add_uint32(k, value)
    for name, shape in {"token_embd.weight": (8, 16), "output_norm.weight": (16,), **tensors}.items():
        w.add_tensor(name, np.linspace(1, 2, int(np.prod(shape)), dtype=np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return R.open_gguf(path)


@pytest.mark.parametrize("arch_name,keys,tensors,why", [
    ("mamba", {}, {}, "not 'mamba'"),
    ("llama", {"rope.scaling.type": "longrope"}, {}, "rope.scaling.type"),
    ("llama", {"expert_weights_scale": 2.5}, {}, "expert_weights_scale"),
    ("llama", {}, {"blk.0.attn_output.bias": (16,)}, "attn_output.bias"),
    ("llama", {"rope.dimension_count": 4}, {}, "rope.dimension_count"),
    ("qwen3", {}, {"rope_freqs.weight": (4,)}, "rope_freqs"),
    ("qwen3", {"attention.key_length": 8, "attention.value_length": 4}, {}, "value_length"),
    ("gemma3", {"attention.sliding_window": 4, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}, {},
     "gemma3"),
])
def test_read_config_refuses_what_it_does_not_implement(tmp_path, arch_name, keys, tensors, why):
    reader = _tiny_gguf(tmp_path / "m.gguf", arch_name, keys, tensors)
    with pytest.raises(ValueError, match=why):
        R.read_config(reader)


def test_long_or_short_factors_follow_the_padded_context(tmp_path):
    """get_rope_factors: long when n_ctx_seq > original_context_length, n_ctx_seq being n_ctx
    rounded up to a multiple of 256 (llama_context)."""
    reader = _tiny_gguf(tmp_path / "phi3.gguf", "phi3", {"rope.scaling.original_context_length": 300},
                        {"rope_factors_long.weight": (4,), "rope_factors_short.weight": (4,)})
    picked = {n: R.read_config(reader, n).rope_factors_name for n in (32, 256, 257, 512)}
    assert picked == {32: "rope_factors_short.weight", 256: "rope_factors_short.weight",
                      257: "rope_factors_long.weight", 512: "rope_factors_long.weight"}


# ---------------------------------------------------------------------------------------------
# the models


def test_config_reads_each_feature(arch):
    c, ref = arch.ref.config, arch.ref
    assert c.n_ctx == 512
    if arch.name == "llama3":
        assert (c.arch, c.rope_neox, c.tied_output, c.rope_factors_name) == ("llama", False, True, "rope_freqs.weight")
        assert c.rope_freq_scale == 0.5 and c.rope_ext_factor == 0.0
        ff = np.asarray(c.rope_factors)
        assert len(ff) == 32 and ff[0] == 1.0 and ff[-1] == 16.0 and np.all(np.diff(ff) >= 0)
    elif arch.name == "llama-yarn":
        assert (c.arch, c.rope_neox, c.tied_output, c.rope_factors) == ("llama", False, False, None)
        assert (c.rope_freq_scale, c.rope_ext_factor, c.rope_n_ctx_orig, c.n_ctx_train) == (0.25, 1.0, 1024, 4096)
        assert R.rope_scaling(c, c.rope_base)["mscale"] == pytest.approx(1.0)  # llama.cpp cancels its own
    elif arch.name == "qwen3":
        assert (c.arch, c.rope_neox, c.tied_output, c.qk_norm) == ("qwen3", True, True, True)
        assert (c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_rot) == (256, 4, 2, 128, 128)
        assert c.attn_scale == pytest.approx(128 ** -0.5)
        assert not any(name.endswith(".bias") for name in ref.weights)
    elif arch.name == "gemma2":
        assert (c.arch, c.rope_neox, c.tied_output, c.qk_norm) == ("gemma2", True, True, False)
        assert (c.attn_softcap, c.final_softcap, c.sliding_window) == (3.0, 4.0, 8)
        assert c.local_layers == (True, False, True, False)
        assert c.embd_scale == 16.0 and c.head_dim == 128 and c.attn_scale == pytest.approx(128 ** -0.5)
    elif arch.name == "phi3":
        assert (c.arch, c.rope_neox, c.tied_output) == ("phi3", True, False)
        assert (c.head_dim, c.n_rot, c.n_head_kv, c.rope_n_ctx_orig, c.n_ctx_train) == (64, 48, 2, 32, 4096)
        assert c.rope_factors_name == "rope_factors_long.weight"
        assert c.rope_attn_factor == pytest.approx(math.sqrt(1 + math.log(128) / math.log(32)))
        long, short = ref.weights["rope_factors_long.weight"], ref.weights["rope_factors_short.weight"]
        assert np.asarray(c.rope_factors) == pytest.approx(long) and np.abs(long - short).max() > 5
        assert ref.weights["blk.0.attn_qkv.weight"].shape == (256 + 2 * 128, 256)
        assert ref.weights["blk.0.ffn_up.weight"].shape == (2 * c.n_ff, 256)
    types = set(ref.types.values())
    assert "F16" in types and types & {"Q4_K", "Q6_K"} and "F32" in types


@pytest.mark.parametrize("mode", list(MODES))
def test_logits_agree_with_llamacpp(arch, mode):
    cos, top1 = arch.agreement(arch.logits(ggml_numerics=MODES[mode]))
    bad = [(int(i), round(float(cos[i]), 5)) for i in np.flatnonzero(cos < MIN_COS)]
    msg = (f"{arch.name} ({mode}) vs llama.cpp: cosine min {cos.min():.5f} median {np.median(cos):.5f}, "
           f"top-1 {top1:.3f}; positions under {MIN_COS}: {bad}")
    print(msg)
    assert not bad, msg
    assert top1 >= MIN_TOP1, msg


@pytest.mark.parametrize("name,variant", OFF_CASES, ids=[f"{n}-{v}" for n, v in OFF_CASES])
def test_each_feature_matters(name, variant, archs):
    """The reference without the feature does not reach the agreement (f32 logits)."""
    arch = archs(name)
    cos, top1 = arch.agreement(arch.logits(variant))
    msg = (f"{name} with {variant}: cosine min {cos.min():.4f} median {np.median(cos):.4f}, top-1 {top1:.3f}")
    print(msg)
    assert not (cos.min() >= MIN_COS and top1 >= MIN_TOP1), msg


@pytest.mark.parametrize("name", AM.MOE_NAMES)
def test_no_token_is_routed_on_a_near_tie(name, archs):
    """The models' seeds (arch_models.MOE_SEEDS) route the fixture text clearly: at every token and
    layer the last chosen expert's router logit exceeds the next one's by MIN_ROUTER_GAP, far more
    than llama.cpp and the engine differ by, so both choose the same experts."""
    arch = archs(name)
    gaps = []
    original = R.moe_ffn_block

    def recording(x, L, cfg):
        logits = np.sort(L["ffn_gate_inp"](R.rms_norm(x, L["ffn_norm"], cfg.eps)), axis=-1)[:, ::-1]
        gaps.append(logits[:, cfg.n_expert_used - 1] - logits[:, cfg.n_expert_used])
        return original(x, L, cfg)

    R.moe_ffn_block = recording
    try:
        arch.ref.forward(arch.fx["ids"].tolist())
    finally:
        R.moe_ffn_block = original
    assert len(gaps) == arch.ref.config.n_layer
    assert np.concatenate(gaps).min() >= AM.MIN_ROUTER_GAP


def test_feature_variants_change_the_config_only(arch):
    """Each variant shares the weights and differs from the model only in what it switches off."""
    for variant, make in OFF[arch.name].items():
        other = make(arch.ref)
        assert other.weights is arch.ref.weights
        changed = {f.name for f in dataclasses.fields(R.Config)
                   if getattr(other.config, f.name) != getattr(arch.ref.config, f.name)}
        assert len(changed) <= 2, (variant, changed)

"""Random-weight test models for the architecture variants people bring, made deterministically.

    python -m tests.arch_models llama3 qwen3 ...   # make (or find) the files, print their paths

Each is a small GGUF (hidden 256, 3-4 layers) with fixed-seed random weights and SmolLM2's real
tokenizer (every tokenizer.* key but the chat template, copied from the SmolLM2 GGUF), matrices
in F16 and K types (written by tests/quant_models.py's packers), norms and rope factors in F32.
Every feature is switched on hard enough to move the logits clearly (tests/test_arch_reference.py
checks that the reference without it disagrees with llama.cpp):

* "llama3": Llama 3 RoPE: a global rope_freqs.weight (ff_i from 1 to 16, made by the HF converter's
  llama3 rule) and rope.scaling.type "linear" with factor 2 on top; tied output.
* "llama-yarn": rope.scaling.type "yarn", factor 4, original_context_length 1024 (YaRN's ramp over
  pairs 5..18 of 32); untied output.
* "qwen3": per-head q/k RMSNorm before RoPE (weights far from 1), head_dim 128 from key_length
  while n_embd / n_head = 64, GQA 4/2, NEOX RoPE, no biases, tied output.
* "gemma2": attention and final logit soft-capping (caps 3 and 4, below the raw values), sliding window 8
  on the even layers of 4, sandwich norms, GELU FFN, sqrt(n_embd) embedding scale, key_length 128
  != n_embd / n_head (the query scale rule), tied output.
* "phi3": fused attn_qkv with GQA, fused gate|up ffn_up, partial rotary (48 of 64 dims),
  rope_factors_long / _short (far from 1 and from each other), original_context_length 32 of
  4096 and the converter's attn_factor sqrt(1 + ln(4096/32) / ln 32); untied output.
* "qwen3moe", "mixtral" (llama with experts) and "olmoe": mixtures of experts, 2 layers, 8, 4 and 8
  experts of which 2 per token, F32 routers, seeds chosen so that no token's choice is a near-tie,
  expert stacks in F16, and in the last layer Q4_K (gate), F16 (up) and Q6_K (down); qwen3moe with qwen3's attention and
  renormalised weights, mixtral llama's (NORM RoPE, tied output), olmoe q/k norms over all heads
  and weights not renormalised.

Files are cached with tests/quant_models.py's cache (~/.cache/rqllm/test-models/), named by a hash
of the tokenizer source, of quant_models' packers and of this module's code.  llama.cpp's logits
on them are fixtures (tests/tools/make_arch_fixtures.py); `arch_fixture` loads them.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from tests import quant_models as QM

ARCH_NAMES = ("llama3", "llama-yarn", "qwen3", "gemma2", "phi3", "qwen3moe", "mixtral", "olmoe")
MOE_NAMES = ("qwen3moe", "mixtral", "olmoe")


class _Maker:
    """A GGUFWriter with SmolLM2's tokenizer, a seeded generator and typed tensor adds."""

    def __init__(self, dst: Path, arch: str, tokenizer_src: Path, seed: int):
        self.rng = np.random.default_rng(seed)
        reader = GGUFReader(str(tokenizer_src))
        self.vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        self.w = GGUFWriter(str(dst), arch)
        # not the architecture's name: llama.cpp's vocabulary loader special-cases a general.name
        # containing "phi3" / "phi-3" and then requires Phi-3's "</s>" token (llama-vocab.cpp)
        self.w.add_name("rqllm random-weight test model")
        self.w.add_file_type(int(LlamaFileType.MOSTLY_Q4_K_M))
        for name, f in reader.fields.items():
            if not name.startswith("tokenizer.") or name == "tokenizer.chat_template":
                continue
            vtype = f.types[0]
            sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
            self.w.add_key_value(name, f.contents(), vtype, sub_type=sub)
        self.written: dict[str, str] = {}

    def mat(self, rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        """(rows, cols) = `rows` outputs of `cols` inputs; unit-RMS input -> outputs of RMS gain."""
        return self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / np.sqrt(cols))

    def vec(self, n: int, mean: float, spread: float) -> np.ndarray:
        return (mean + spread * self.rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def add(self, name: str, w: np.ndarray, type_name: str = "F32") -> None:
        if w.ndim == 1:
            self.w.add_tensor(name, w.astype(np.float32))
            self.written[name] = "F32"
            return
        t = QM.type_for_row(type_name, w.shape[1])
        QM._add(self.w, name, w, t)
        self.written[name] = t

    def f32(self, key: str, value: float) -> None:
        self.w.add_float32(key, float(value))

    def u32(self, key: str, value: int) -> None:
        self.w.add_uint32(key, int(value))

    def common(self, *, ctx: int, n_embd: int, n_layer: int, n_ff: int, n_head: int, n_head_kv: int,
               base: float, eps: float = 1e-6) -> None:
        w = self.w
        w.add_context_length(ctx)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(base)
        w.add_layer_norm_rms_eps(eps)

    def finish(self) -> dict[str, str]:
        QM._write(self.w)
        return self.written


def llama3_rope_factors(head_dim: int, base: float, factor: float, low_ff: float, high_ff: float,
                        orig: int) -> np.ndarray:
    """rope_freqs as convert_hf_to_gguf writes them for rope_type "llama3" (conversion/llama.py
    generate_extra_tensors): 1 for short wavelengths, `factor` for long ones, smooth between."""
    # math.pow in float64, not numpy's float32 power: numpy's SIMD power differs by CPU (its AVX-512
    # and AVX2 versions round differently), and these bytes must be the same on every machine
    powers = np.array([math.pow(base, i / head_dim) for i in range(0, head_dim, 2)]).astype(np.float32)
    freqs = np.float32(1.0) / powers
    lo_wl, hi_wl = orig / low_ff, orig / high_ff
    out = []
    for freq in freqs:
        wl = 2 * math.pi / freq
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            smooth = (orig / wl - low_ff) / (high_ff - low_ff)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# Matrices are F16 but for two K-type ones per model (and an untied output.weight in Q6_K): llama.cpp
# quantizes the activations entering a K-type matmul to 8 bits (Q8_K), a ~0.6 % error per matmul
# that these tiny random models amplify through their layers; F16 matmuls round to fp16 (0.05 %).
K_TYPES_AT = {(0, "ffn_up"): "Q6_K", (1, "attn_v"): "Q4_K", (1, "attn_qkv"): "Q4_K"}


def _type(il: int, short: str) -> str:
    return K_TYPES_AT.get((il, short), "F16")


def _llama_blocks(m: _Maker, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, g) -> None:
    """llama-style blocks (separate q/k/v, gate/up/down); g: gains."""
    for il in range(n_layer):
        p = f"blk.{il}."
        m.add(p + "attn_norm.weight", m.vec(n_embd, 1.0, 0.1))
        m.add(p + "attn_q.weight", m.mat(n_head * head_dim, n_embd, g["qk"]), _type(il, "attn_q"))
        m.add(p + "attn_k.weight", m.mat(n_head_kv * head_dim, n_embd, g["qk"]), _type(il, "attn_k"))
        m.add(p + "attn_v.weight", m.mat(n_head_kv * head_dim, n_embd, g["v"]), _type(il, "attn_v"))
        if "attn_q_norm" in g:
            m.add(p + "attn_q_norm.weight", m.vec(head_dim, g["attn_q_norm"], 0.4))
            m.add(p + "attn_k_norm.weight", m.vec(head_dim, g["attn_k_norm"], 0.4))
        m.add(p + "attn_output.weight", m.mat(n_embd, n_head * head_dim, g["o"]), _type(il, "attn_output"))
        m.add(p + "ffn_norm.weight", m.vec(n_embd, 1.0, 0.1))
        m.add(p + "ffn_gate.weight", m.mat(n_ff, n_embd, g["ffn"]), _type(il, "ffn_gate"))
        m.add(p + "ffn_up.weight", m.mat(n_ff, n_embd, g["ffn"]), _type(il, "ffn_up"))
        m.add(p + "ffn_down.weight", m.mat(n_embd, n_ff, g["down"]), _type(il, "ffn_down"))


def write_llama3(dst: Path, tokenizer_src: Path) -> dict[str, str]:
    """Exercises Llama 3's rope_freqs (divides each pair's angle) combined with linear scaling."""
    n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, base = 3, 256, 4, 2, 64, 512, 10000.0
    m = _Maker(dst, "llama", tokenizer_src, seed=31)
    m.common(ctx=8192, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
             base=base, eps=1e-5)
    m.u32("llama.rope.dimension_count", head_dim)
    m.w.add_string("llama.rope.scaling.type", "linear")
    m.f32("llama.rope.scaling.factor", 2.0)
    # the llama3 rule with a small original context puts the 1 -> 16 transition at pairs 9..12 of
    # 32, where pos * base^(-2i/64) is a few radians over the 48 test positions
    m.add("rope_freqs.weight", llama3_rope_factors(head_dim, base, 16.0, 1.0, 4.0, 256))
    m.add("token_embd.weight", m.rng.standard_normal((m.vocab, n_embd), dtype=np.float32) * np.float32(0.5), "F16")
    m.add("output_norm.weight", m.vec(n_embd, 1.0, 0.1))
    _llama_blocks(m, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff,
                  {"qk": 1.3, "v": 1.0, "o": 2.0, "ffn": 1.5, "down": 1.0})
    return m.finish()


def write_llama_yarn(dst: Path, tokenizer_src: Path) -> dict[str, str]:
    """Exercises YaRN: the per-pair ramp between interpolated and original angles, and its mscale."""
    n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, base = 3, 256, 4, 2, 64, 512, 10000.0
    m = _Maker(dst, "llama", tokenizer_src, seed=32)
    m.common(ctx=4096, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
             base=base, eps=1e-5)
    m.u32("llama.rope.dimension_count", head_dim)
    m.w.add_string("llama.rope.scaling.type", "yarn")
    m.f32("llama.rope.scaling.factor", 4.0)
    # ggml_rope_yarn_corr_dims: floor/ceil of 64 ln(1024 / (2 pi beta)) / (2 ln 1e4) for beta 32, 1
    # -> pairs 5 .. 18: below 5 the original angles, above 18 the interpolated ones.  (The lower
    # end is > 0 only when original_context_length > 2 pi 32 = 201.)
    m.u32("llama.rope.scaling.original_context_length", 1024)
    m.add("token_embd.weight", m.rng.standard_normal((m.vocab, n_embd), dtype=np.float32) * np.float32(0.5), "F16")
    m.add("output_norm.weight", m.vec(n_embd, 1.0, 0.1))
    m.add("output.weight", m.mat(m.vocab, n_embd, 4.0), "Q6_K")
    _llama_blocks(m, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff,
                  {"qk": 1.3, "v": 1.0, "o": 2.0, "ffn": 1.5, "down": 1.0})
    return m.finish()


def write_qwen3(dst: Path, tokenizer_src: Path) -> dict[str, str]:
    """Exercises qwen3: q/k RMSNorm per head before RoPE, head_dim (128) != n_embd / n_head (64)."""
    n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, base = 3, 256, 4, 2, 128, 512, 1_000_000.0
    m = _Maker(dst, "qwen3", tokenizer_src, seed=33)
    m.common(ctx=4096, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
             base=base)
    m.w.add_key_length(head_dim)
    m.w.add_value_length(head_dim)
    m.add("token_embd.weight", m.rng.standard_normal((m.vocab, n_embd), dtype=np.float32) * np.float32(0.5), "F16")
    m.add("output_norm.weight", m.vec(n_embd, 1.0, 0.1))
    # q/k of RMS ~0.3 that the norms (mean 2.5) lift to ~2.5: without them the scores go flat
    _llama_blocks(m, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff,
                  {"qk": 0.3, "v": 1.0, "o": 2.0, "ffn": 1.5, "down": 1.0,
                   "attn_q_norm": 1.3, "attn_k_norm": 1.3})
    return m.finish()


def write_gemma2(dst: Path, tokenizer_src: Path) -> dict[str, str]:
    """Exercises gemma2: attention/final soft-caps, sliding window 8 on even layers, sandwich
    norms, GELU, sqrt(n_embd) embedding scale, q scale 1/sqrt(key_length) with key_length != E/H."""
    n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, base = 4, 256, 4, 2, 128, 512, 10000.0
    m = _Maker(dst, "gemma2", tokenizer_src, seed=34)
    m.common(ctx=8192, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
             base=base)
    m.w.add_key_length(head_dim)
    m.w.add_value_length(head_dim)
    m.u32("gemma2.attention.sliding_window", 8)
    m.f32("gemma2.attn_logit_softcapping", 3.0)
    m.f32("gemma2.final_logit_softcapping", 4.0)
    # embeddings of RMS 0.06, x sqrt(256) ~ 1 in the residual stream; the output norm (mean 3)
    # spreads the tied logits to an RMS of ~3, beyond the final cap of 4 at the top
    m.add("token_embd.weight", m.rng.standard_normal((m.vocab, n_embd), dtype=np.float32) * np.float32(0.06), "F16")
    m.add("output_norm.weight", m.vec(n_embd, 3.0, 0.3))
    for il in range(n_layer):
        p = f"blk.{il}."
        m.add(p + "attn_norm.weight", m.vec(n_embd, 1.0, 0.1))
        m.add(p + "attn_q.weight", m.mat(n_head * head_dim, n_embd, 1.6), _type(il, "attn_q"))
        m.add(p + "attn_k.weight", m.mat(n_head_kv * head_dim, n_embd, 1.6), _type(il, "attn_k"))
        m.add(p + "attn_v.weight", m.mat(n_head_kv * head_dim, n_embd, 1.0), _type(il, "attn_v"))
        m.add(p + "attn_output.weight", m.mat(n_embd, n_head * head_dim, 1.0), _type(il, "attn_output"))
        m.add(p + "post_attention_norm.weight", m.vec(n_embd, 2.0, 0.3))
        m.add(p + "ffn_norm.weight", m.vec(n_embd, 1.0, 0.1))
        m.add(p + "ffn_gate.weight", m.mat(n_ff, n_embd, 1.5), _type(il, "ffn_gate"))
        m.add(p + "ffn_up.weight", m.mat(n_ff, n_embd, 1.5), _type(il, "ffn_up"))
        m.add(p + "ffn_down.weight", m.mat(n_embd, n_ff, 1.0), _type(il, "ffn_down"))
        m.add(p + "post_ffw_norm.weight", m.vec(n_embd, 1.0, 0.3))
    return m.finish()


PHI3_ORIG_CTX, PHI3_CTX = 32, 4096


def write_phi3(dst: Path, tokenizer_src: Path) -> dict[str, str]:
    """Exercises phi3: fused qkv (GQA) and gate|up, partial rotary, LongRoPE long/short factors
    and attn_factor."""
    n_layer, n_embd, n_head, n_head_kv, n_ff, base = 3, 256, 4, 2, 512, 10000.0
    head_dim = n_embd // n_head  # 64; phi3's q is n_embd wide
    n_rot = 48  # partial_rotary_factor 0.75, as Phi-4-mini
    e_kv = n_head_kv * head_dim
    m = _Maker(dst, "phi3", tokenizer_src, seed=35)
    m.common(ctx=PHI3_CTX, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
             base=base, eps=1e-5)
    m.u32("phi3.rope.dimension_count", n_rot)
    m.u32("phi3.rope.scaling.original_context_length", PHI3_ORIG_CTX)
    scale = PHI3_CTX / PHI3_ORIG_CTX  # conversion/phi.py, rope_type longrope
    m.f32("phi3.rope.scaling.attn_factor", math.sqrt(1 + math.log(scale) / math.log(PHI3_ORIG_CTX)))
    x = np.arange(n_rot // 2, dtype=np.float64) / (n_rot // 2 - 1)
    # long: 1 -> ~20 over the pairs, as LongRoPE's long factors grow; short: 1 -> ~3, flatter.
    # x ** 1.5 as x * sqrt(x), in float64: IEEE operations round alike on every CPU, and numpy's
    # float32 power does not (its AVX-512 and AVX2 versions differ in the last bit)
    m.add("rope_factors_long.weight", (1.0 + 19.0 * (x * np.sqrt(x))).astype(np.float32))
    m.add("rope_factors_short.weight", (1.0 + 2.0 * x).astype(np.float32))
    m.add("token_embd.weight", m.rng.standard_normal((m.vocab, n_embd), dtype=np.float32) * np.float32(0.5), "F16")
    m.add("output_norm.weight", m.vec(n_embd, 1.0, 0.1))
    m.add("output.weight", m.mat(m.vocab, n_embd, 4.0), "Q6_K")
    for il in range(n_layer):
        p = f"blk.{il}."
        m.add(p + "attn_norm.weight", m.vec(n_embd, 1.0, 0.1))
        qkv = np.concatenate([m.mat(n_embd, n_embd, 0.9), m.mat(e_kv, n_embd, 0.9), m.mat(e_kv, n_embd, 1.0)])
        m.add(p + "attn_qkv.weight", qkv, _type(il, "attn_qkv"))  # rows: q [0, 256), k [256, 384), v [384, 512)
        m.add(p + "attn_output.weight", m.mat(n_embd, n_embd, 2.0), _type(il, "attn_output"))
        m.add(p + "ffn_norm.weight", m.vec(n_embd, 1.0, 0.1))
        # rows: gate [0, 512), up [512, 1024)
        m.add(p + "ffn_up.weight", m.mat(2 * n_ff, n_embd, 1.5), _type(il, "ffn_up"))
        m.add(p + "ffn_down.weight", m.mat(n_embd, n_ff, 1.0), _type(il, "ffn_down"))
    return m.finish()


# Seeds whose models route the fixture text (tests.quant_models.smollm2_text_ids(48)) with no near-tie:
# at every token and layer the n_used-th and next router logits differ by >= MIN_ROUTER_GAP in the
# reference, so rounding cannot hand a token to another expert in one engine and not in the other
# (tests/test_arch_reference.py checks it).
MOE_SEEDS = {"qwen3moe": 38, "mixtral": 37, "olmoe": 36}
MIN_ROUTER_GAP = 0.01


def _add_stack(m: _Maker, name: str, n_expert: int, rows: int, cols: int, gain: float, type_name: str) -> None:
    """A 3-D expert stack {cols, rows, n_expert}: expert e's matrix is slab e."""
    w = np.stack([m.mat(rows, cols, gain) for _ in range(n_expert)])
    t = QM.type_for_row(type_name, cols)
    data = QM.quantize_rows(w.reshape(n_expert * rows, cols), t)
    m.w.add_tensor(name, data.reshape(n_expert, rows, -1), raw_dtype=QM.T[t])
    m.written[name] = t


def _moe_blocks(m: _Maker, n_layer, n_embd, n_head, n_head_kv, head_dim, n_expert, n_ff_exp, qk_norm: str) -> None:
    """Attention as llama/qwen3 (qk_norm: "" none, "head" per head, "full" over all heads) and an
    experts' FFN: router ffn_gate_inp (F32, logits of RMS ~2.5), gate/up/down stacks. K types only in
    the last layer: every router then reads a residual stream made by F16 matmuls, which llama.cpp
    and we compute alike to ~0.05 %, so a token's experts are the same in both (MIN_ROUTER_GAP)."""
    for il in range(n_layer):
        p = f"blk.{il}."
        k_types = il == n_layer - 1
        m.add(p + "attn_norm.weight", m.vec(n_embd, 1.0, 0.1))
        gain_qk = 0.3 if qk_norm else 1.3
        m.add(p + "attn_q.weight", m.mat(n_head * head_dim, n_embd, gain_qk), "F16")
        m.add(p + "attn_k.weight", m.mat(n_head_kv * head_dim, n_embd, gain_qk), "F16")
        m.add(p + "attn_v.weight", m.mat(n_head_kv * head_dim, n_embd, 1.0), "Q4_K" if k_types else "F16")
        if qk_norm:
            nq, nk = (n_head * head_dim, n_head_kv * head_dim) if qk_norm == "full" else (head_dim, head_dim)
            m.add(p + "attn_q_norm.weight", m.vec(nq, 1.3, 0.4))
            m.add(p + "attn_k_norm.weight", m.vec(nk, 1.3, 0.4))
        m.add(p + "attn_output.weight", m.mat(n_embd, n_head * head_dim, 2.0), "F16")
        m.add(p + "ffn_norm.weight", m.vec(n_embd, 1.0, 0.1))
        m.add(p + "ffn_gate_inp.weight", m.mat(n_expert, n_embd, 2.5), "F32")
        _add_stack(m, p + "ffn_gate_exps.weight", n_expert, n_ff_exp, n_embd, 1.5, "Q4_K" if k_types else "F16")
        _add_stack(m, p + "ffn_up_exps.weight", n_expert, n_ff_exp, n_embd, 1.5, "F16")
        _add_stack(m, p + "ffn_down_exps.weight", n_expert, n_embd, n_ff_exp, 1.0, "Q6_K" if k_types else "F16")


def write_qwen3moe(dst: Path, tokenizer_src: Path) -> dict[str, str]:
    """Exercises qwen3moe: qwen3's attention; 8 experts of width 256 (expert_feed_forward_length,
    not feed_forward_length), top 2, weights renormalised."""
    n_layer, n_embd, n_head, n_head_kv, head_dim, n_expert, n_ff_exp = 2, 256, 4, 2, 128, 8, 256
    m = _Maker(dst, "qwen3moe", tokenizer_src, seed=MOE_SEEDS["qwen3moe"])
    m.common(ctx=4096, n_embd=n_embd, n_layer=n_layer, n_ff=768, n_head=n_head, n_head_kv=n_head_kv,
             base=1_000_000.0)
    m.w.add_key_length(head_dim)
    m.w.add_value_length(head_dim)
    m.w.add_expert_count(n_expert)
    m.w.add_expert_used_count(2)
    m.u32("qwen3moe.expert_feed_forward_length", n_ff_exp)
    m.add("token_embd.weight", m.rng.standard_normal((m.vocab, n_embd), dtype=np.float32) * np.float32(0.5), "F16")
    m.add("output_norm.weight", m.vec(n_embd, 1.0, 0.1))
    _moe_blocks(m, n_layer, n_embd, n_head, n_head_kv, head_dim, n_expert, n_ff_exp, "head")
    return m.finish()


def write_mixtral(dst: Path, tokenizer_src: Path) -> dict[str, str]:
    """Exercises llama with experts (Mixtral): NORM RoPE, 4 experts of width feed_forward_length, top 2,
    weights renormalised, tied output (an untied one here left many logits near-tied at the top)."""
    n_layer, n_embd, n_head, n_head_kv, head_dim, n_expert, n_ff = 2, 256, 4, 2, 64, 4, 256
    m = _Maker(dst, "llama", tokenizer_src, seed=MOE_SEEDS["mixtral"])
    m.common(ctx=4096, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
             base=10000.0, eps=1e-5)
    m.u32("llama.rope.dimension_count", head_dim)
    m.w.add_expert_count(n_expert)
    m.w.add_expert_used_count(2)
    m.add("token_embd.weight", m.rng.standard_normal((m.vocab, n_embd), dtype=np.float32) * np.float32(0.5), "F16")
    m.add("output_norm.weight", m.vec(n_embd, 1.0, 0.1))
    _moe_blocks(m, n_layer, n_embd, n_head, n_head_kv, head_dim, n_expert, n_ff, "")
    return m.finish()


def write_olmoe(dst: Path, tokenizer_src: Path) -> dict[str, str]:
    """Exercises olmoe: q/k RMSNorm over the whole projection before the head split, 8 experts of
    width feed_forward_length, top 2, weights not renormalised, untied output."""
    n_layer, n_embd, n_head, n_expert, n_ff = 2, 256, 4, 8, 256
    head_dim = n_embd // n_head  # olmoe's k norm is n_embd wide: no GQA
    m = _Maker(dst, "olmoe", tokenizer_src, seed=MOE_SEEDS["olmoe"])
    m.common(ctx=4096, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head,
             base=10000.0, eps=1e-5)
    m.w.add_expert_count(n_expert)
    m.w.add_expert_used_count(2)
    m.add("token_embd.weight", m.rng.standard_normal((m.vocab, n_embd), dtype=np.float32) * np.float32(0.5), "F16")
    m.add("output_norm.weight", m.vec(n_embd, 1.0, 0.1))
    m.add("output.weight", m.mat(m.vocab, n_embd, 4.0), "Q6_K")
    _moe_blocks(m, n_layer, n_embd, n_head, n_head, head_dim, n_expert, n_ff, "full")
    return m.finish()


WRITERS = {"llama3": write_llama3, "llama-yarn": write_llama_yarn, "qwen3": write_qwen3,
           "gemma2": write_gemma2, "phi3": write_phi3, "qwen3moe": write_qwen3moe, "mixtral": write_mixtral,
           "olmoe": write_olmoe}


def _key(src: Path, name: str) -> str:
    """quant_models' key (the tokenizer source's bytes, its packers' code) plus this module's code."""
    text = Path(__file__).read_text(encoding="utf-8")
    code = text[text.index('\n"""\n') + 5: text.index("\n" + _CODE_END)].encode()
    h = hashlib.sha256()
    for piece in (QM._key(src, "arch", name).encode(), code):
        h.update(hashlib.sha256(piece).digest())
    return h.hexdigest()[:12]


def arch_model(name: str, tokenizer_src: str | os.PathLike) -> Path:
    """The cached random-weight model `name` (one of ARCH_NAMES), tokenizer copied from tokenizer_src
    (SmolLM2's GGUF: engine.registry.resolve("smollm2-135m"), conftest's smollm2_path)."""
    if name not in WRITERS:
        raise ValueError(f"unknown arch model {name!r}; one of {', '.join(ARCH_NAMES)}")
    src = Path(tokenizer_src)
    return QM._cached(f"arch-{name}-{_key(src, name)}.gguf", lambda tmp: WRITERS[name](tmp, src))


_CODE_END = "# ---- end of what makes the bytes"
# ---- end of what makes the bytes
# ---------------------------------------------------------------------------------------------
# test helpers: llama.cpp's fixtures (tests/tools/make_arch_fixtures.py)

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_path(name: str) -> Path:
    return FIXTURES / f"llamacpp_arch_{name}.npz"


def arch_fixture(name: str, model_path: str | os.PathLike) -> dict:
    """llama.cpp's logits on arch model `name` (ids, vocab_ids, logits, top1, margins, n_ctx, sha256,
    llama_cpp_version); skips when missing or made from a file with other bytes."""
    import pytest

    path = fixture_path(name)
    if not path.exists():
        pytest.skip(f"{path.name} missing (tests/tools/make_arch_fixtures.py {name} writes it)")
    with np.load(path, allow_pickle=False) as z:
        fx = {k: z[k] for k in z.files}
    for k in ("sha256", "llama_cpp_version"):
        fx[k] = str(fx[k])
    fx["n_ctx"] = int(fx["n_ctx"])
    sha = QM.file_sha256(model_path)
    if sha != fx["sha256"]:
        pytest.skip(f"{Path(model_path).name} (sha256 {sha[:12]}) is not the file {path.name} was made "
                    f"from ({fx['sha256'][:12]}): the model maker's output changed; rerun "
                    f"tests/tools/make_arch_fixtures.py {name}")
    return fx


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.registry import resolve

    smollm2 = resolve("smollm2-135m")
    for name in argv or ARCH_NAMES:
        path = arch_model(name, smollm2)
        print(f"{name}\t{path}\t{path.stat().st_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

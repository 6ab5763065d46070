"""A plain numpy reference forward pass for the `llama`, `gemma3`, `qwen2`, `qwen3`, `gemma2` and
`phi3` GGUF architectures.

This is the ground truth the fast engine is tested against, so it is written to be read and
trusted, not to be fast: every weight is dequantized to float32 once (gguf.quants.dequantize),
all math is float32 numpy, and each pass of a layer is one plain function, top to bottom.

    ref = ReferenceModel(path)      # n_ctx=512: the context llama.cpp is assumed to run with
    ref.config                      # Config: shapes, eps, rope bases and scaling, sliding window ...
    ref.forward(tokens)             # [n, vocab] logits at every position
    ref.forward_layers(tokens)      # (residual stream after embedding and after each layer, logits)
    ref.greedy(tokens, n)           # n greedy token ids

Conventions (checked against llama.cpp: src/models/llama.cpp, src/models/gemma3.cpp,
src/llama-model.cpp, src/llama-hparams.cpp, ggml's rope):

* Weights: GGUF stores a 2-D tensor as ggml [ne0=in, ne1=out]; GGUFReader hands back the data
  row-major as (out, in), so y = x @ W.T.
* llama: RMSNorm, RoPE on adjacent pairs (ggml "normal" mode; the HF->GGUF converter permuted the
  rows of Wq/Wk so this matches HF's rotate_half), grouped-query attention (query head h uses KV
  head h // (n_head / n_head_kv)), scores scaled by 1/sqrt(head_dim), SwiGLU FFN, output weight =
  token_embd when output.weight is absent.
* gemma3: embeddings scaled by sqrt(n_embd); per-head RMSNorm of q and k; NEOX RoPE (pairs i,
  i + d/2); q scaled by 1/sqrt(head_dim) (the attention itself then uses scale 1); post-attention
  and post-FFN RMSNorms before each residual add; GELU (tanh approximation) gated FFN.  Layer il
  is local (sliding window, rope base 10000) when il % 6 < 5, global (rope base
  gemma3.rope.freq_base) otherwise.  In a local layer a query at position p sees keys at
  positions k with p - k < sliding_window (llama_hparams::is_masked_swa, LLAMA_SWA_TYPE_STANDARD).
  The GGUF norm weights already include Gemma's "+1": use them as they are.  No logit softcapping.
* qwen2 (src/models/qwen2.cpp): a llama block with biases added to q, k and v
  (blk.N.attn_{q,k,v}.bias) before RoPE, and NEOX RoPE; output.weight untied when present.
* qwen3 (src/models/qwen3.cpp): a llama block without biases, NEOX RoPE, head_dim from
  attention.key_length (H * head_dim may differ from n_embd), and per-head RMSNorm of q and k
  (attn_q_norm / attn_k_norm, over head_dim) before RoPE.
* gemma2 (src/models/gemma2.cpp): gemma3's sandwich block without q/k norms, embeddings scaled by
  sqrt(n_embd), q scaled by 1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the 46-layer 27B) after
  RoPE; attention logits soft-capped c * tanh(s / c) before mask and softmax
  (attn_logit_softcapping, src/llama-graph.cpp build_attn_mha) and the output logits too
  (final_logit_softcapping); sliding window pattern 2: even layers local, odd global
  (llama_hparams::set_swa_pattern); output always tied.
* phi3 (src/models/phi3.cpp): fused attn_qkv (rows: q, then k, then v), fused ffn_up whose first
  n_ff outputs are the gate (silu) and the next n_ff the up projection (ggml_swiglu), NEOX RoPE on
  the first rope.dimension_count dims of each head only, q scaled by 1/sqrt(head_dim).
* RoPE scaling (every architecture; ggml-cpu ops.cpp rope_yarn / ggml_rope_cache_init,
  ggml.c ggml_rope_yarn_corr_dims, src/llama-context.cpp, src/llama-model.cpp get_rope_factors):
  pair i turns by theta_i = pos * base^(-2i/n_rot) / ff_i, with ff_i the file's frequency factors
  (rope_freqs.weight, Llama 3; or rope_factors_long/short.weight, Phi-3 LongRoPE: long when the
  context exceeds rope.scaling.original_context_length); "linear" multiplies theta by 1/factor;
  "yarn" mixes the linear and the unscaled angle per pair and scales cos/sin; the file's
  rope.scaling.attn_factor scales cos and sin of the rotated dims.

The model is run from position 0 with full causal attention; `greedy` keeps the keys and values of
earlier positions (a plain list per layer) so each new token costs one position, and computes
exactly what `forward` would on the longer sequence (a test checks this).

Every pass also takes ggml_numerics=True, which rounds where llama.cpp's CPU backend rounds
(activations quantized to Q8_0/Q8_1/Q8_K before quantized matmuls, fp16 KV cache, fp16 GELU
table).  With it, each matmul, norm, RoPE and attention reproduces llama.cpp's intermediate
tensors to ~1e-6 relative given the same inputs; end to end the two modes differ from llama.cpp
by about as much as llama.cpp differs from itself between batched and token-by-token evaluation
(rounding flips compound through the layers), see tests/test_reference.py.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

__all__ = ["Config", "ReferenceModel", "load", "blas_threads", "rms_norm", "rope", "rope_scaling",
           "yarn_corr_dims", "gelu_tanh", "silu", "attention"]


# ----------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class Config:
    arch: str  # "llama" | "gemma3" | "qwen2"
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab: int
    eps: float
    rope_base: float  # global layers (all layers for llama)
    rope_base_local: float  # sliding-window layers (gemma3); == rope_base for llama
    n_rot: int  # rotated dimensions per head
    rope_neox: bool  # True: pairs (i, i + n_rot/2); False: adjacent pairs (2i, 2i+1)
    sliding_window: int | None  # None: every layer attends to all earlier positions
    swa_pattern: int | None  # layer il is local when il % swa_pattern < swa_pattern - 1
    embd_scale: float  # token embeddings are multiplied by this (sqrt(n_embd) for gemma3)
    attn_scale: float  # multiplies q.k
    tied_output: bool  # logits use token_embd (no output.weight)
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    n_ctx_train: int
    local_layers: tuple[bool, ...] = field(default=())
    # RoPE scaling (all defaults: none).  See rope() and rope_scaling().
    n_ctx: int = 512  # the context llama.cpp runs with (picks Phi-3's long or short factors)
    rope_freq_scale: float = 1.0  # 1 / rope.scaling.factor ("linear" and "yarn")
    rope_ext_factor: float = 0.0  # YaRN's extrapolation mix: 1 for rope.scaling.type "yarn"
    rope_n_ctx_orig: int = 0  # rope.scaling.original_context_length (YaRN's correction dims)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor
    rope_factors: tuple[float, ...] | None = None  # ff_i: theta_i is divided by it
    rope_factors_name: str | None = None  # the tensor they came from
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (gemma3, qwen3)
    attn_softcap: float | None = None  # attention logits -> c * tanh(s / c) (gemma2)
    final_softcap: float | None = None  # output logits -> c * tanh(l / c) (gemma2)
    n_expert: int = 0  # > 0: the FFN is a mixture of experts (moe_ffn_block)
    n_expert_used: int = 0
    expert_norm: bool = False  # the chosen experts' weights renormalised to sum 1

    def is_local(self, il: int) -> bool:
        return bool(self.local_layers) and self.local_layers[il]

    def layer_rope_base(self, il: int) -> float:
        return self.rope_base_local if self.is_local(il) else self.rope_base


class _Reader(GGUFReader):
    """GGUFReader, opening ~3x faster: its many tiny metadata reads (one per vocabulary entry)
    slice the np.memmap, and every memmap slice pays for subclass bookkeeping; slicing a plain
    ndarray view of the same mapping gives the same arrays.  Overrides the private _get()."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset: offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: str | Path) -> GGUFReader:
    try:
        return _Reader(path)
    except (TypeError, AttributeError):  # a gguf release whose internals changed: the plain reader
        return GGUFReader(path)


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


ARCHS = ("llama", "gemma3", "qwen2", "qwen3", "gemma2", "phi3", "qwen3moe", "olmoe")
DEFAULT_N_CTX = 512  # the n_ctx every llama.cpp fixture is recorded with (tests/tools/*.py)

# The tensors each architecture's layer function reads (blk.N.<name>.weight / .bias); a file with
# any other tensor is refused rather than run without it.
LAYER_TENSORS = {
    "llama": {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
              "ffn_up", "ffn_down"},
    "qwen2": {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
              "ffn_up", "ffn_down", "attn_q_bias", "attn_k_bias", "attn_v_bias"},
    "qwen3": {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
              "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"},
    "gemma3": {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
               "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"},
    "gemma2": {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm",
               "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"},
    "phi3": {"attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"},
}
EXPERT_TENSORS = {"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
_ATTN_QK_NORM = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm"}
LAYER_TENSORS["qwen3moe"] = _ATTN_QK_NORM | EXPERT_TENSORS
LAYER_TENSORS["olmoe"] = _ATTN_QK_NORM | EXPERT_TENSORS
LAYER_TENSORS["llama-moe"] = LAYER_TENSORS["llama"] - {"ffn_gate", "ffn_up", "ffn_down"} | EXPERT_TENSORS
GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight",
                  "rope_factors_long.weight", "rope_factors_short.weight"}


def read_config(reader: GGUFReader, n_ctx: int = DEFAULT_N_CTX) -> Config:
    """The Config of a GGUF file, llama.cpp running it with an n_ctx-token context."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"reference supports {', '.join(ARCHS)}, not {arch!r}")
    a = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    n_embd = int(a("embedding_length"))
    n_head = int(a("attention.head_count"))
    n_head_kv = int(a("attention.head_count_kv", n_head))
    head_dim = int(a("attention.key_length", n_embd // n_head))
    if int(a("attention.value_length", head_dim)) != head_dim:
        raise ValueError("attention.value_length != key_length is not implemented in the reference")
    n_layer = int(a("block_count"))
    tensors = {t.name: t for t in reader.tensors}
    names = set(tensors)
    n_expert = int(a("expert_count", 0) or 0)
    _check_tensors("llama-moe" if arch == "llama" and n_expert else arch, names)
    tok_embd = tensors["token_embd.weight"]
    vocab = int(tok_embd.shape[1])  # GGUF order: [n_embd, vocab]
    rope_base = float(a("rope.freq_base", 10000.0))
    window, pattern, local = None, None, ()
    rope_base_local = rope_base
    embd_scale = 1.0
    if arch == "gemma3":
        window = int(a("attention.sliding_window"))
        pattern = 6
        local = tuple(il % pattern < pattern - 1 for il in range(n_layer))
        rope_base_local = 10000.0  # llama.cpp: hparams.rope_freq_base_train_swa for gemma3
        embd_scale = math.sqrt(n_embd)
    elif arch == "gemma2":
        # src/models/gemma2.cpp load_arch_hparams: n_swa default 4096, load_swa_pattern(ml, 2),
        # rope_freq_base_train_swa = rope.freq_base_swa or rope.freq_base
        window = int(a("attention.sliding_window", 4096))
        pattern = a("attention.sliding_window_pattern", 2)
        if not isinstance(pattern, int):
            raise ValueError("a per-layer sliding_window_pattern array is not implemented in the reference")
        local = tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer))
        rope_base_local = float(a("rope.freq_base_swa", rope_base))
        embd_scale = math.sqrt(n_embd)  # gemma2.cpp: ggml_scale(inpL, sqrtf(n_embd))
    # llama.cpp (llama_model_rope_type): LLAMA_ROPE_TYPE_NORM for llama, NEOX for the others
    neox = arch != "llama"
    attn_scale = 1.0 / math.sqrt(head_dim)
    if arch == "gemma3" and n_layer == 62:  # llama.cpp: Gemma 3 27B uses query_pre_attn_scalar
        attn_scale = 1.0 / math.sqrt(n_embd / n_head)
    if arch == "gemma2" and n_layer == 46:  # gemma2.cpp: LLM_TYPE_27B scales q by 1/sqrt(n_embd/n_head)
        attn_scale = 1.0 / math.sqrt(n_embd / n_head)
    if a("attention.scale") is not None:
        raise ValueError("a GGUF attention.scale is not implemented in the reference")
    for key in ("expert_weights_scale", "rope.scaling.yarn_log_multiplier", "rope.dimension_sections"):
        if a(key) not in (None, 0, 0.0):
            raise ValueError(f"{arch}.{key} is not implemented in the reference")
    n_rot = int(a("rope.dimension_count", head_dim))
    if n_rot != head_dim and arch != "phi3":  # llama.cpp asserts n_rot == head_dim for the others
        raise ValueError(f"rope.dimension_count {n_rot} != head_dim {head_dim} is only implemented for phi3")
    n_ctx_train = int(a("context_length", 0))
    # -- RoPE scaling (src/llama-model.cpp load_hparams, src/llama-context.cpp) -----------------
    # rope.scaling.type defaults to "linear"; freq_scale = 1/factor (factor absent or 0 -> 1);
    # "none" forces freq_scale 1; ext_factor = 1 for "yarn", else 0 (llama.cpp's context default)
    scaling = a("rope.scaling.type", "linear")
    if scaling not in ("none", "linear", "yarn"):
        raise ValueError(f"rope.scaling.type {scaling!r} is not implemented in the reference")
    factor = float(a("rope.scaling.factor", a("rope.scale_linear", 0.0)) or 0.0)
    freq_scale = 1.0 if factor == 0.0 or scaling == "none" else 1.0 / factor
    n_ctx_orig = int(a("rope.scaling.original_context_length", n_ctx_train) or n_ctx_train)
    # get_rope_factors: rope_freqs when present, else long if n_ctx_seq > n_ctx_orig_yarn, else
    # short; n_ctx_seq is n_ctx rounded up to a multiple of 256 (llama_context: GGML_PAD(n_ctx, 256)).
    # arch llama loads long/short only for scaling type "longrope" (refused above), phi3 always.
    n_ctx_seq = -(-int(n_ctx) // 256) * 256
    if arch == "gemma3" and (freq_scale != 1.0 or scaling == "yarn"):
        # gemma3's local layers keep their own freq_scale (rope_freq_scale_train_swa): not modelled
        raise ValueError("rope scaling is not implemented in the reference for gemma3")
    factors_name = None
    if "rope_freqs.weight" in names:
        if arch != "llama":  # only llama.cpp's llama graph reads rope_freqs (src/models/llama.cpp)
            raise ValueError(f"rope_freqs.weight in an {arch} file is not implemented in the reference")
        factors_name = "rope_freqs.weight"
    elif arch == "phi3" and {"rope_factors_long.weight", "rope_factors_short.weight"} & names:
        factors_name = "rope_factors_long.weight" if n_ctx_seq > n_ctx_orig else "rope_factors_short.weight"
        if factors_name not in names:
            factors_name = None  # TENSOR_NOT_REQUIRED: llama.cpp then rotates without factors
    elif {"rope_factors_long.weight", "rope_factors_short.weight"} & names:
        raise ValueError(f"rope_factors_long/short in an {arch} file are not implemented in the reference")
    factors = None
    if factors_name is not None:
        ff = np.asarray(tensors[factors_name].data, dtype=np.float32).reshape(-1)
        if len(ff) != n_rot // 2:
            raise ValueError(f"{factors_name} has {len(ff)} values, not n_rot/2 = {n_rot // 2}")
        factors = tuple(float(v) for v in ff)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return Config(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=int(a("feed_forward_length")),
        vocab=vocab,
        eps=float(a("attention.layer_norm_rms_epsilon")),
        rope_base=rope_base,
        rope_base_local=rope_base_local,
        n_rot=n_rot,
        rope_neox=neox,
        sliding_window=window,
        swa_pattern=pattern,
        embd_scale=embd_scale,
        attn_scale=attn_scale,
        tied_output="output.weight" not in names or arch == "gemma2",  # gemma2.cpp: always tied
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        n_ctx_train=n_ctx_train,
        local_layers=local,
        n_ctx=int(n_ctx),
        rope_freq_scale=freq_scale,
        rope_ext_factor=1.0 if scaling == "yarn" else 0.0,
        rope_n_ctx_orig=n_ctx_orig,
        rope_attn_factor=float(a("rope.scaling.attn_factor", 1.0)),
        rope_factors=factors,
        rope_factors_name=factors_name,
        qk_norm=arch in ("gemma3", "qwen3", "qwen3moe", "olmoe"),
        # gemma2.cpp: attn_soft_cap = true, caps default 50 and 30 (llama-hparams.h)
        attn_softcap=float(a("attn_logit_softcapping", 50.0)) if arch == "gemma2" else None,
        final_softcap=float(a("final_logit_softcapping", 30.0)) if arch == "gemma2" else None,
        n_expert=n_expert,
        n_expert_used=int(a("expert_used_count", 0) or 0),
        # build_moe_ffn's norm_w: true in src/models/qwen3moe.cpp and llama.cpp, false in olmoe.cpp
        expert_norm=arch in ("qwen3moe", "llama"),
    )


def _check_tensors(arch: str, names: set[str]) -> None:
    """Refuse a file with a tensor the reference would silently ignore."""
    unknown = []
    for name in names:
        if name.startswith("blk."):
            short, _, kind = name.split(".", 1)[1].partition(".")[2].rpartition(".")
            short = short + ("_bias" if kind == "bias" else "")
            if kind not in ("weight", "bias") or short not in LAYER_TENSORS[arch]:
                unknown.append(name)
        elif name not in GLOBAL_TENSORS:
            unknown.append(name)
    if unknown:
        raise ValueError(f"{arch} tensors not implemented in the reference: {sorted(unknown)[:8]}")


# ----------------------------------------------------------------------------------------------
# the building blocks (all float32)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + np.float32(eps))) * w


def rope(x: np.ndarray, pos: np.ndarray, base: float, n_rot: int, neox: bool, *,
         freq_factors=None, freq_scale: float = 1.0, ext_factor: float = 0.0,
         corr_dims: tuple[float, float] = (0.0, 0.0), mscale: float = 1.0) -> np.ndarray:
    """Rotary embedding of x [n, heads, head_dim] at positions pos [n].

    Pair i (0 <= i < n_rot/2) is rotated by angle pos * base^(-2i/n_rot).  The pair is
    (x[2i], x[2i+1]) in ggml's normal mode and (x[i], x[i + n_rot/2]) in NEOX mode.
    Dimensions from n_rot on are left alone (not scaled by mscale either).

    Scaling, as ggml-cpu's ggml_rope_cache_init / rope_yarn (ops.cpp) computes it:
    theta_extrap = pos * base^(-2i/n_rot) / freq_factors[i]; theta_interp = freq_scale *
    theta_extrap; without YaRN (ext_factor 0) theta = theta_interp; with it
    theta = theta_interp * (1 - m) + theta_extrap * m, m = ext_factor * ramp(i) (ramp 1 below
    corr_dims[0], 0 above corr_dims[1], linear between), and mscale is multiplied by
    1 + 0.1 ln(1 / freq_scale).  cos and sin are multiplied by mscale.
    """
    half = n_rot // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    theta = pos.astype(np.float64)[:, None] * inv_freq[None, :]  # [n, half]
    if freq_factors is not None:
        theta = theta / np.asarray(freq_factors, dtype=np.float64)[None, :]
    if ext_factor != 0.0:
        low, high = corr_dims
        ramp = 1.0 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0.0, 1.0)  # rope_yarn_ramp
        mix = ramp * ext_factor
        theta = freq_scale * theta * (1.0 - mix) + theta * mix
        mscale = mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    elif freq_scale != 1.0:
        theta = freq_scale * theta
    cos = np.cos(theta)
    sin = np.sin(theta)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    cos = cos.astype(np.float32)[:, None, :]  # [n, 1, half] broadcast over heads
    sin = sin.astype(np.float32)[:, None, :]
    out = x.copy()
    if neox:
        x0, x1 = x[..., :half], x[..., half:n_rot]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:n_rot] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return out


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float):
    """ggml.c ggml_rope_yarn_corr_dims: the pair range over which YaRN's ramp falls from 1 to 0.

    corr_dim(beta) = n_rot * ln(n_ctx_orig / (2 pi beta)) / (2 ln base); start = floor(corr_dim
    (beta_fast)) clamped at 0, end = ceil(corr_dim(beta_slow)) clamped at n_rot - 1."""
    def corr_dim(beta):
        return n_rot * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr_dim(beta_fast))), min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))


def rope_scaling(cfg: Config, base: float) -> dict:
    """rope()'s scaling arguments for a layer with this rope base.

    The attn_factor llama.cpp hands to ggml_rope_ext (src/llama-context.cpp): with YaRN
    (ext_factor != 0) get_mscale(factor) = 1 + 0.1 ln(factor), divided by 1 + 0.1 ln(factor)
    ("we need to cancel this factor", as rope_yarn multiplies it in again), then times the file's
    rope.scaling.attn_factor.  Net on cos/sin: (1 + 0.1 ln factor) * attn_factor with YaRN,
    attn_factor without (Phi-3 LongRoPE)."""
    mscale = 1.0
    if cfg.rope_ext_factor != 0.0:
        factor = 1.0 / cfg.rope_freq_scale
        get_mscale = 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0
        mscale = get_mscale / (1.0 + 0.1 * math.log(factor))
    mscale *= cfg.rope_attn_factor
    if (cfg.rope_factors is None and cfg.rope_freq_scale == 1.0 and cfg.rope_ext_factor == 0.0
            and mscale == 1.0):
        return {}  # plain RoPE
    corr = (0.0, 0.0)
    if cfg.rope_ext_factor != 0.0:
        corr = yarn_corr_dims(cfg.n_rot, cfg.rope_n_ctx_orig, base, cfg.rope_beta_fast, cfg.rope_beta_slow)
    return {"freq_factors": cfg.rope_factors, "freq_scale": cfg.rope_freq_scale,
            "ext_factor": cfg.rope_ext_factor, "corr_dims": corr, "mscale": mscale}


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (ggml_gelu)."""
    c = np.float32(math.sqrt(2.0 / math.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * x * (np.float32(1.0) + np.float32(0.044715) * x * x)))


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    scale: float,
    window: int | None,
    ggml_numerics: bool = False,
    softcap: float | None = None,
) -> np.ndarray:
    """Causal (optionally sliding-window) attention with grouped KV heads.

    q [n, n_head, d], k/v [m, n_head_kv, d], positions q_pos [n], k_pos [m].
    Query i sees key j when k_pos[j] <= q_pos[i] and, with a window, q_pos[i] - k_pos[j] < window.
    With softcap c the scores s = q.k become c * tanh(s / c) before the mask and the softmax's
    scale (src/llama-graph.cpp build_attn_mha: kq -> scale 1/c, tanh, scale c -> soft_max_ext).
    Returns [n, n_head, d].  With ggml_numerics, q/k/v and the softmax weights are rounded to fp16.
    """
    if ggml_numerics:
        q, k, v = f16(q), f16(k), f16(v)
    n_head, n_head_kv = q.shape[1], k.shape[1]
    group = n_head // n_head_kv
    allowed = k_pos[None, :] <= q_pos[:, None]  # [n, m]
    if window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    out = np.empty_like(q)
    for h in range(n_head):
        kh, vh = k[:, h // group, :], v[:, h // group, :]
        if softcap is None:
            scores = (q[:, h, :] @ kh.T) * np.float32(scale)  # [n, m]
        else:
            scores = np.float32(softcap) * np.tanh((q[:, h, :] @ kh.T) / np.float32(softcap))
            scores = scores * np.float32(scale)
        scores = np.where(allowed, scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        if ggml_numerics:
            p = f16(p)
        out[:, h, :] = p @ vh
    return out


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [n, in] times a GGUF weight w stored (out, in): [n, out]."""
    return x @ w.T


# ---- optional: llama.cpp's CPU numerics (ggml_numerics=True) ---------------------------------
# By default everything is float32.  llama.cpp's CPU backend rounds in a few places, and the
# reference can round the same way, to show that its remaining differences from llama.cpp are
# rounding, not structure (and to give the engine a tighter target):
# * an activation row entering a quantized matmul is quantized to the weight's vec_dot_type:
#   Q8_0 (blocks of 32, fp16 scale) for Q4_0/Q5_0/Q8_0; Q8_1 for Q4_1/Q5_1, the same values plus
#   s = fp16(d * sum q) per block, which multiplies the weight block's min m; Q8_K (blocks of 256,
#   f32 scale from the signed extreme) for the K-quants;
# * the KV cache is fp16, so K·q and V·softmax are fp16 dot products (q and the softmax weights
#   are rounded to fp16 too);
# * GELU is looked up in an fp16 table.
# Dot products are then exact sums of products (integer in ggml), float32 here: agreement with
# llama.cpp's intermediate tensors is ~1e-6 relative per matmul.

ACT_QUANT = {  # weight type -> how ggml quantizes the activation row it is multiplied with
    "Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1",
    "Q2_K": "q8_k", "Q3_K": "q8_k", "Q4_K": "q8_k", "Q5_K": "q8_k", "Q6_K": "q8_k",
    "IQ4_NL": "q8_0", "IQ4_XS": "q8_k",
}


def f16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to fp16 and back."""
    return x.astype(np.float16).astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml-cpu quantize_row_q8_0 (x86): blocks of 32, d = amax/127, q = rint(x * 127/amax).

    x [n, k] -> (q [n, k/32, 32] as float32 integers, d [n, k/32, 1] float32, fp16(d) same shape).
    """
    n, k = x.shape
    xb = x.reshape(n, k // 32, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.rint(xb * inv)
    return q, d, f16(d)


def act_q8_0(x: np.ndarray) -> np.ndarray:
    """x as the Q8_0 block values ggml multiplies with."""
    q, _, d16 = quantize_q8_0(x)
    return (q * d16).reshape(x.shape)


def act_q8_1_sum_error(x: np.ndarray) -> np.ndarray:
    """Q8_1's s = fp16(d * sum q) minus the fp16(d) * sum q the Q8_0 values imply, [n, k/32]."""
    q, d, d16 = quantize_q8_0(x)
    sq = q.sum(axis=-1)
    return f16(d[..., 0] * sq) - d16[..., 0] * sq


def act_q8_k(x: np.ndarray) -> np.ndarray:
    """x as the Q8_K block values ggml multiplies with (quantize_row_q8_K_ref)."""
    n, k = x.shape
    xb = x.reshape(n, k // 256, 256)
    idx = np.abs(xb).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(xb, idx, axis=-1)  # the signed value of largest magnitude
    iscale = np.divide(np.float32(-127), mx, out=np.zeros_like(mx), where=mx != 0)
    q = np.minimum(np.rint(iscale * xb), 127)  # nearest_int rounds half to even
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    return (q * d).reshape(n, k).astype(np.float32)


def gelu_tanh_f16_table(x: np.ndarray) -> np.ndarray:
    """ggml's GELU with GGML_GELU_FP16: gelu of the fp16-rounded input, rounded to fp16."""
    y = f16(gelu_tanh(f16(x)))
    return np.where(x <= -10.0, np.float32(0), np.where(x >= 10.0, x, y)).astype(np.float32)


@dataclass
class Linear:
    """A GGUF matrix (out, in) dequantized to float32: y = x @ w.T.

    act_quant (ggml numerics only): "q8_0" | "q8_1" | "q8_k" | None; for "q8_1", mins [out, in/32]
    holds the weight blocks' m values (Q4_1/Q5_1), which multiply Q8_1's rounded block sums.
    """

    w: np.ndarray
    act_quant: str | None = None
    mins: np.ndarray | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.act_quant is None:
            return matmul(x, self.w)
        if self.act_quant == "q8_k":
            return matmul(act_q8_k(x), self.w)
        y = matmul(act_q8_0(x), self.w)
        if self.act_quant == "q8_1":
            y = y + matmul(act_q8_1_sum_error(x), self.mins)
        return y


# ----------------------------------------------------------------------------------------------
# layers


def swiglu_ffn_block(x, L, cfg: Config):
    """The llama-family feed-forward with its residual: x + down(silu(gate(h)) * up(h)), h = rmsnorm(x)."""
    h = rms_norm(x, L["ffn_norm"], cfg.eps)
    f = silu(L["ffn_gate"](h)) * L["ffn_up"](h)
    return x + L["ffn_down"](f)


def moe_ffn_block(x, L, cfg: Config):
    """A mixture-of-experts feed-forward with its residual (llama.cpp's build_moe_ffn, softmax gating):
    router probabilities softmax(ffn_gate_inp h) over all experts, the n_expert_used largest chosen
    (largest first), their probabilities as weights (renormalised to sum 1 when cfg.expert_norm),
    x + sum_k w_k down_k(silu(gate_k h) * up_k h) with expert k's slices of the 3-D stacks."""
    h = rms_norm(x, L["ffn_norm"], cfg.eps)
    logits = np.asarray(L["ffn_gate_inp"](h), dtype=np.float64)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    gate, up, down = L["ffn_gate_exps"], L["ffn_up_exps"], L["ffn_down_exps"]  # [n_expert, rows, cols]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[:cfg.n_expert_used]
        w = probs[t, chosen]
        if cfg.expert_norm:
            w = w / max(w.sum(), 6.103515625e-5)
        for e, we in zip(chosen, w):
            f = silu(gate[e] @ h[t]) * (up[e] @ h[t])
            out[t] += np.float32(we) * (down[e] @ f)
    return x + out


def causal_attention_block(x, q, k, v, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """The llama-family attention after RoPE, with its residual: keys and values into the cache,
    full causal attention scaled by cfg.attn_scale, the output projection added to x."""
    n = x.shape[0]
    k_all, v_all, k_pos = cache.append(il, k, v, pos)
    a = attention(q, k_all, v_all, pos, k_pos, cfg.attn_scale, None, ggml_numerics)
    return x + L["attn_output"](a.reshape(n, cfg.n_head * cfg.head_dim))


def llama_layer(x, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """One llama block: x += attn(rmsnorm(x)); x += swiglu_ffn(rmsnorm(x))."""
    n = x.shape[0]
    # attention
    h = rms_norm(x, L["attn_norm"], cfg.eps)
    q = L["attn_q"](h).reshape(n, cfg.n_head, cfg.head_dim)
    k = L["attn_k"](h).reshape(n, cfg.n_head_kv, cfg.head_dim)
    v = L["attn_v"](h).reshape(n, cfg.n_head_kv, cfg.head_dim)
    scaling = rope_scaling(cfg, cfg.rope_base)  # Llama 3 rope_freqs, linear, YaRN
    q = rope(q, pos, cfg.rope_base, cfg.n_rot, neox=False, **scaling)
    k = rope(k, pos, cfg.rope_base, cfg.n_rot, neox=False, **scaling)
    x = causal_attention_block(x, q, k, v, L, cfg, il, pos, cache, ggml_numerics)
    return moe_ffn_block(x, L, cfg) if cfg.n_expert else swiglu_ffn_block(x, L, cfg)  # Mixtral: experts


def gemma3_layer(x, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """One gemma3 block: pre- and post-norms around attention and FFN, q/k norms, NEOX RoPE."""
    n = x.shape[0]
    base = cfg.layer_rope_base(il)
    window = cfg.sliding_window if cfg.is_local(il) else None
    # attention
    h = rms_norm(x, L["attn_norm"], cfg.eps)
    q = L["attn_q"](h).reshape(n, cfg.n_head, cfg.head_dim)
    k = L["attn_k"](h).reshape(n, cfg.n_head_kv, cfg.head_dim)
    v = L["attn_v"](h).reshape(n, cfg.n_head_kv, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, L["attn_q_norm"], cfg.eps)  # per head, over head_dim
        k = rms_norm(k, L["attn_k_norm"], cfg.eps)
    q = rope(q, pos, base, cfg.n_rot, neox=True)
    k = rope(k, pos, base, cfg.n_rot, neox=True)
    q = q * np.float32(cfg.attn_scale)  # gemma scales q; the attention then uses scale 1
    k_all, v_all, k_pos = cache.append(il, k, v, pos)
    a = attention(q, k_all, v_all, pos, k_pos, 1.0, window, ggml_numerics)
    a = L["attn_output"](a.reshape(n, cfg.n_head * cfg.head_dim))
    x = x + rms_norm(a, L["post_attention_norm"], cfg.eps)
    # feed-forward
    h = rms_norm(x, L["ffn_norm"], cfg.eps)
    gelu = gelu_tanh_f16_table if ggml_numerics else gelu_tanh
    f = gelu(L["ffn_gate"](h)) * L["ffn_up"](h)
    f = L["ffn_down"](f)
    x = x + rms_norm(f, L["post_ffw_norm"], cfg.eps)
    return x


def qwen2_layer(x, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """One qwen2 block: a llama block with q/k/v biases and NEOX RoPE."""
    n = x.shape[0]
    # attention
    h = rms_norm(x, L["attn_norm"], cfg.eps)
    q = (L["attn_q"](h) + L["attn_q_bias"]).reshape(n, cfg.n_head, cfg.head_dim)
    k = (L["attn_k"](h) + L["attn_k_bias"]).reshape(n, cfg.n_head_kv, cfg.head_dim)
    v = (L["attn_v"](h) + L["attn_v_bias"]).reshape(n, cfg.n_head_kv, cfg.head_dim)
    scaling = rope_scaling(cfg, cfg.rope_base)
    q = rope(q, pos, cfg.rope_base, cfg.n_rot, cfg.rope_neox, **scaling)  # NEOX for qwen2 (a test flips it)
    k = rope(k, pos, cfg.rope_base, cfg.n_rot, cfg.rope_neox, **scaling)
    x = causal_attention_block(x, q, k, v, L, cfg, il, pos, cache, ggml_numerics)
    return swiglu_ffn_block(x, L, cfg)


def qwen3_attention(x, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """qwen3's attention with its residual (src/models/qwen3.cpp, qwen3moe.cpp): head_dim from key_length,
    per-head RMSNorm of q and k before RoPE (attn_q_norm / attn_k_norm), NEOX RoPE, no biases."""
    n = x.shape[0]
    h = rms_norm(x, L["attn_norm"], cfg.eps)
    q = L["attn_q"](h).reshape(n, cfg.n_head, cfg.head_dim)
    k = L["attn_k"](h).reshape(n, cfg.n_head_kv, cfg.head_dim)
    v = L["attn_v"](h).reshape(n, cfg.n_head_kv, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, L["attn_q_norm"], cfg.eps)  # per head, over head_dim; v is not normed
        k = rms_norm(k, L["attn_k_norm"], cfg.eps)
    scaling = rope_scaling(cfg, cfg.rope_base)
    q = rope(q, pos, cfg.rope_base, cfg.n_rot, cfg.rope_neox, **scaling)
    k = rope(k, pos, cfg.rope_base, cfg.n_rot, cfg.rope_neox, **scaling)
    return causal_attention_block(x, q, k, v, L, cfg, il, pos, cache, ggml_numerics)


def qwen3_layer(x, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """One qwen3 block (src/models/qwen3.cpp): qwen3's attention, the llama feed-forward."""
    return swiglu_ffn_block(qwen3_attention(x, L, cfg, il, pos, cache, ggml_numerics), L, cfg)


def gemma2_layer(x, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """One gemma2 block (src/models/gemma2.cpp): sandwich norms around attention and FFN, NEOX RoPE,
    q scaled after RoPE, soft-capped attention logits, sliding window on local (even) layers."""
    n = x.shape[0]
    base = cfg.layer_rope_base(il)
    window = cfg.sliding_window if cfg.is_local(il) else None
    # attention
    h = rms_norm(x, L["attn_norm"], cfg.eps)
    q = L["attn_q"](h).reshape(n, cfg.n_head, cfg.head_dim)
    k = L["attn_k"](h).reshape(n, cfg.n_head_kv, cfg.head_dim)
    v = L["attn_v"](h).reshape(n, cfg.n_head_kv, cfg.head_dim)
    scaling = rope_scaling(cfg, base)
    q = rope(q, pos, base, cfg.n_rot, cfg.rope_neox, **scaling)
    k = rope(k, pos, base, cfg.n_rot, cfg.rope_neox, **scaling)
    q = q * np.float32(cfg.attn_scale)  # gemma2.cpp: ggml_scale(Qcur, f_attention_scale), kq_scale 1
    k_all, v_all, k_pos = cache.append(il, k, v, pos)
    a = attention(q, k_all, v_all, pos, k_pos, 1.0, window, ggml_numerics, softcap=cfg.attn_softcap)
    a = L["attn_output"](a.reshape(n, cfg.n_head * cfg.head_dim))
    x = x + rms_norm(a, L["post_attention_norm"], cfg.eps)
    # feed-forward
    h = rms_norm(x, L["ffn_norm"], cfg.eps)
    gelu = gelu_tanh_f16_table if ggml_numerics else gelu_tanh
    f = gelu(L["ffn_gate"](h)) * L["ffn_up"](h)
    f = L["ffn_down"](f)
    x = x + rms_norm(f, L["post_ffw_norm"], cfg.eps)
    return x


def phi3_layer(x, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """One phi3 block (src/models/phi3.cpp): fused q|k|v and gate|up matrices, NEOX RoPE on the
    first n_rot dims of each head (with LongRoPE factors and attn_factor), q scaled by
    1/sqrt(head_dim) after RoPE, attention scale 1."""
    n = x.shape[0]
    e_q, e_kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    # attention
    h = rms_norm(x, L["attn_norm"], cfg.eps)
    qkv = L["attn_qkv"](h)  # llama-graph.cpp build_qkv: views at 0, e_q, e_q + e_kv
    q = qkv[:, :e_q].reshape(n, cfg.n_head, cfg.head_dim)
    k = qkv[:, e_q:e_q + e_kv].reshape(n, cfg.n_head_kv, cfg.head_dim)
    v = qkv[:, e_q + e_kv:].reshape(n, cfg.n_head_kv, cfg.head_dim)
    scaling = rope_scaling(cfg, cfg.rope_base)
    q = rope(q, pos, cfg.rope_base, cfg.n_rot, cfg.rope_neox, **scaling)
    k = rope(k, pos, cfg.rope_base, cfg.n_rot, cfg.rope_neox, **scaling)
    q = q * np.float32(cfg.attn_scale)
    k_all, v_all, k_pos = cache.append(il, k, v, pos)
    a = attention(q, k_all, v_all, pos, k_pos, 1.0, None, ggml_numerics)
    x = x + L["attn_output"](a.reshape(n, e_q))
    # feed-forward: ggml_swiglu on ffn_up's 2 * n_ff outputs: silu(first half) * second half
    h = rms_norm(x, L["ffn_norm"], cfg.eps)
    gu = L["ffn_up"](h)
    f = silu(gu[:, :cfg.n_ff]) * gu[:, cfg.n_ff:]
    x = x + L["ffn_down"](f)
    return x


def qwen3moe_layer(x, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """One qwen3moe block (src/models/qwen3moe.cpp): qwen3's attention, a mixture-of-experts FFN."""
    return moe_ffn_block(qwen3_attention(x, L, cfg, il, pos, cache, ggml_numerics), L, cfg)


def olmoe_layer(x, L, cfg: Config, il: int, pos, cache, ggml_numerics=False):
    """One olmoe block (src/models/olmoe.cpp): q and k RMS-normed over the whole projection (all
    heads at once) before the head split and NEOX RoPE; a mixture of experts without renormalised weights."""
    n = x.shape[0]
    h = rms_norm(x, L["attn_norm"], cfg.eps)
    q = rms_norm(L["attn_q"](h), L["attn_q_norm"], cfg.eps).reshape(n, cfg.n_head, cfg.head_dim)
    k = rms_norm(L["attn_k"](h), L["attn_k_norm"], cfg.eps).reshape(n, cfg.n_head_kv, cfg.head_dim)
    v = L["attn_v"](h).reshape(n, cfg.n_head_kv, cfg.head_dim)
    scaling = rope_scaling(cfg, cfg.rope_base)
    q = rope(q, pos, cfg.rope_base, cfg.n_rot, cfg.rope_neox, **scaling)
    k = rope(k, pos, cfg.rope_base, cfg.n_rot, cfg.rope_neox, **scaling)
    x = causal_attention_block(x, q, k, v, L, cfg, il, pos, cache, ggml_numerics)
    return moe_ffn_block(x, L, cfg)


LAYER_FNS = {"llama": llama_layer, "gemma3": gemma3_layer, "qwen2": qwen2_layer, "qwen3": qwen3_layer,
             "gemma2": gemma2_layer, "phi3": phi3_layer, "qwen3moe": qwen3moe_layer, "olmoe": olmoe_layer}


class KVCache:
    """Keys/values (after RoPE) and their positions per layer; empty for a one-shot forward."""

    def __init__(self, n_layer: int):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.pos = [None] * n_layer

    def append(self, il, k, v, pos):
        if self.k[il] is None:
            self.k[il], self.v[il], self.pos[il] = k, v, pos
        else:
            self.k[il] = np.concatenate([self.k[il], k])
            self.v[il] = np.concatenate([self.v[il], v])
            self.pos[il] = np.concatenate([self.pos[il], pos])
        return self.k[il], self.v[il], self.pos[il]

    @property
    def n_pos(self) -> int:
        return 0 if self.pos[0] is None else len(self.pos[0])


# ----------------------------------------------------------------------------------------------
# the model


class ReferenceModel:
    """A GGUF model dequantized to float32, run by the plain functions above.

    Every pass takes ggml_numerics=False (plain float32); True rounds where llama.cpp's CPU
    backend rounds (see "optional: llama.cpp's CPU numerics" above).
    """

    def __init__(self, path: str | Path, n_ctx: int = DEFAULT_N_CTX):
        """n_ctx: the context llama.cpp is taken to run with; it decides only which of Phi-3's
        rope_factors_long / _short apply (the fixtures are recorded with n_ctx 512)."""
        self.path = Path(path)
        reader = open_gguf(self.path)
        self.config = read_config(reader, n_ctx)
        self.types = {t.name: t.tensor_type.name for t in reader.tensors}
        self.weights = {t.name: self._dequant(t) for t in reader.tensors}  # name -> float32 array
        # Q4_1/Q5_1 block mins, for ggml numerics only (Q8_1 rounding): name -> [out, in/32]
        self._mins = {t.name: self._block_mins(t) for t in reader.tensors
                      if t.tensor_type.name in ("Q4_1", "Q5_1")}
        del reader
        cfg = self.config
        self.tok_embd = self.weights["token_embd.weight"]  # [vocab, n_embd]
        self.output_name = "token_embd.weight" if cfg.tied_output else "output.weight"
        self.output_norm = self.weights["output_norm.weight"]
        self._layer_fn = LAYER_FNS[cfg.arch]
        self._layers = {False: self._build_layers(False), True: None}  # True built on first use
        self._output = {False: self._linear(self.output_name, False),
                        True: self._linear(self.output_name, True)}

    def _linear(self, name: str, ggml_numerics: bool) -> Linear:
        if not ggml_numerics:
            return Linear(self.weights[name])
        return Linear(self.weights[name], ACT_QUANT.get(self.types[name]), self._mins.get(name))

    def _build_layers(self, ggml_numerics: bool) -> list[dict]:
        """Per layer: short name ("attn_q", "ffn_norm", ...) -> Linear (matrices) or array (norms);
        biases under "<name>_bias" ("attn_q_bias")."""
        layers = []
        for il in range(self.config.n_layer):
            prefix = f"blk.{il}."
            L = {}
            for name, w in self.weights.items():
                if name.startswith(prefix) and name.endswith(".weight"):
                    short = name[len(prefix): -len(".weight")]
                    L[short] = self._linear(name, ggml_numerics) if w.ndim == 2 else w
                elif name.startswith(prefix) and name.endswith(".bias"):
                    L[name[len(prefix): -len(".bias")] + "_bias"] = w
            layers.append(L)
        return layers

    @property
    def layers(self) -> list[dict]:
        return self._layers[False]

    def variant(self, **config_changes) -> "ReferenceModel":
        """The same weights under a changed Config, e.g. variant(sliding_window=None)."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, **config_changes)
        return other

    @staticmethod
    def _dequant(t) -> np.ndarray:
        w = dequantize(t.data, t.tensor_type)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if not w.flags.writeable:  # an F32 tensor is a view of the read-only file mapping: copy it
            w = w.copy()
        expect = tuple(int(d) for d in reversed(t.shape))  # GGUF order is [ne0, ne1, ...]
        if w.shape != expect:
            w = w.reshape(expect)
        return w

    @staticmethod
    def _block_mins(t) -> np.ndarray:
        """The fp16 m of every Q4_1/Q5_1 block (bytes 2-3 of each block: d, m, ...)."""
        block_bytes = {"Q4_1": 20, "Q5_1": 24}[t.tensor_type.name]
        raw = np.asarray(t.data).reshape(int(t.shape[1]), -1, block_bytes)
        return np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)

    # -- passes ---------------------------------------------------------------------------

    def embed(self, tokens) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence of ids")
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise ValueError("token id out of range")
        x = self.tok_embd[ids]
        if self.config.embd_scale != 1.0:
            x = x * np.float32(self.config.embd_scale)
        return x.astype(np.float32)

    def logits(self, x: np.ndarray, ggml_numerics: bool = False) -> np.ndarray:
        """Final RMSNorm and the output matrix: residual stream [n, n_embd] -> [n, vocab]."""
        h = rms_norm(x, self.output_norm, self.config.eps)
        out = self._output[ggml_numerics](h)
        cap = self.config.final_softcap
        if cap is not None:  # gemma2.cpp: final logit soft-capping
            out = np.float32(cap) * np.tanh(out / np.float32(cap))
        return out

    def _run(self, tokens, cache: KVCache, keep_layers: bool, ggml_numerics: bool):
        if ggml_numerics and self._layers[True] is None:
            self._layers[True] = self._build_layers(True)  # shares the arrays
        start = cache.n_pos
        pos = np.arange(start, start + len(tokens), dtype=np.int64)
        x = self.embed(tokens)
        stream = [x] if keep_layers else None
        for il, L in enumerate(self._layers[ggml_numerics]):
            x = self._layer_fn(x, L, self.config, il, pos, cache, ggml_numerics)
            if keep_layers:
                stream.append(x)
        return x, stream

    def hidden(self, tokens, ggml_numerics: bool = False) -> np.ndarray:
        """The residual stream after the last layer, [len(tokens), n_embd] (before output_norm)."""
        x, _ = self._run(tokens, KVCache(self.config.n_layer), False, ggml_numerics)
        return x

    def forward(self, tokens, ggml_numerics: bool = False) -> np.ndarray:
        """Logits [len(tokens), vocab] for every position, the sequence starting at position 0."""
        return self.logits(self.hidden(tokens, ggml_numerics), ggml_numerics)

    def forward_layers(self, tokens, ggml_numerics: bool = False) -> tuple[list[np.ndarray], np.ndarray]:
        """([embedding, after layer 0, ..., after layer n_layer-1], logits); each [n, n_embd]."""
        x, stream = self._run(tokens, KVCache(self.config.n_layer), True, ggml_numerics)
        return stream, self.logits(x, ggml_numerics)

    def greedy(self, tokens, n: int, stop_at_eos: bool = False, ggml_numerics: bool = False) -> list[int]:
        """The n argmax continuations of tokens (the first max wins ties)."""
        cache = KVCache(self.config.n_layer)
        x, _ = self._run(list(tokens), cache, False, ggml_numerics)
        out: list[int] = []
        while len(out) < n:
            nxt = int(np.argmax(self.logits(x[-1:], ggml_numerics)[0]))
            out.append(nxt)
            if stop_at_eos and nxt == self.config.eos_id:
                break
            if len(out) < n:
                x, _ = self._run([nxt], cache, False, ggml_numerics)
        return out


@contextlib.contextmanager
def blas_threads(n: int = 1):
    """Run numpy's matmuls on n OpenBLAS threads inside the block (when that can be set).

    OpenBLAS threads spin while they wait for work; with more threads than free cores (2 cores
    shared with other jobs, or with the engine's own OpenMP threads) the reference's many small
    matmuls run 5-10x slower than on one thread.  Does nothing if numpy's BLAS is not OpenBLAS.
    """
    get, set_ = _openblas_thread_functions()
    if get is None:
        yield
        return
    before = get()
    set_(n)
    try:
        yield
    finally:
        set_(before)


@functools.lru_cache(maxsize=1)
def _openblas_thread_functions():
    libs = sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("lib*openblas*.so*"))
    for lib in libs:
        try:
            dll = ctypes.CDLL(str(lib))
        except OSError:
            continue
        for suffix in ("64_", "_64_", ""):
            for prefix in ("scipy_openblas", "openblas"):
                get = getattr(dll, f"{prefix}_get_num_threads{suffix}", None)
                set_ = getattr(dll, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and set_ is not None:
                    get.restype, get.argtypes = ctypes.c_int, []
                    set_.restype, set_.argtypes = None, [ctypes.c_int]
                    return get, set_
    return None, None


@functools.lru_cache(maxsize=2)
def load(path: str | Path, n_ctx: int = DEFAULT_N_CTX) -> ReferenceModel:
    """A ReferenceModel shared by every caller in this process (loading takes 10-30 s)."""
    return ReferenceModel(path, n_ctx)
